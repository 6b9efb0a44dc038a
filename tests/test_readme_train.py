"""The README's "Train your own model" example runs as written (factory, config file, command lines)."""

import re
import shlex
from pathlib import Path

import numpy as np
import torch

from edgetrain.profile import memory
from edgetrain.cli.main import main
from edgetrain.cli.train_config import load_train_config

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _section() -> str:
    start = README.index("## Train your own model")
    return README[start:README.index("\n## ", start + 1)]


def _block(lang: str, first_line: str = "") -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", _section(), flags=re.S)
    return next(b for b in blocks if b.startswith(first_line))


def test_readme_config_and_factory_run_as_written(tmp_path, monkeypatch, capsys):
    from PIL import Image

    (tmp_path / "my_models.py").write_text(_block("python", "# my_models.py"))
    (tmp_path / "train.yaml").write_text(_block("yaml"))
    rng = np.random.default_rng(0)
    for c, name in enumerate(["circle", "square"]):  # the user's images: my_images/<class>/*.png
        (tmp_path / "my_images" / name).mkdir(parents=True)
        for i in range(10):
            a = (rng.random((20, 20, 3)) * 80).astype(np.uint8)
            a[..., c] += 150
            Image.fromarray(a).save(tmp_path / "my_images" / name / f"{i}.png")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(memory, "_BASELINE_RSS", memory.baseline_rss_bytes())  # `train` moves it; put it back
    command = shlex.split(_block("sh").splitlines()[0].split("#")[0])
    assert command[:2] == ["edgetrain", "train"]
    assert main(command[1:]) == 0
    out = capsys.readouterr().out
    assert "epoch 3/3" in out and "within budget" in out
    state = torch.load(tmp_path / "my_model.pt", weights_only=True)
    assert state["9.weight"].shape == (2, 16)  # num_classes from the folders, width 8 -> 2 * width
    assert (tmp_path / "report.html").exists() and (tmp_path / "logs" / "epochs.csv").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "step-000000003.pt"
    # the second command line's overrides are valid options
    second = shlex.split(_block("sh").splitlines()[1].split("#")[0])
    flags = {second[i][2:].replace("-", "_"): second[i + 1] for i in range(len(second)) if second[i].startswith("--")}
    items = [a for a in second[3:] if "=" in a]
    cfg = load_train_config("train.yaml", flags, items)
    assert (cfg.epochs, cfg.memory_budget, cfg.model_kwargs) == (10, "120MiB", {"width": 16})
