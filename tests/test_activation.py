"""The activation of foreign weights follows the files beside them (issue 26 items 3 and 9):
open_clip's hub layout (open_clip_config.json beside open_clip_model.safetensors, its
"model_cfg" with "quick_gelu", absent = GELU) or this repo's config.json; a flag wins; with
neither, OpenAI's QuickGELU is assumed, said on stderr and recorded as
"quick_gelu_source": "assumed" in the run's config, and eval repeats the note."""
import json
import os
import shutil

import pytest
from conftest import error_lines
import torch
from safetensors.torch import save_file

import composer as C
import data
import lifecycle
import eval_compositional as E
import il_clip as M
import mm_learngene as MM

TINY = ["--model_args", "width=32", "layers=1", "heads=2", "embed_dim=32", "image_size=32", "patch_size=8",
        "code_dim=32", "--batch_size", "8", "--eval_size", "0", "--method", "clip", "--max_steps", "0"]


def hub_config(quick_gelu=None, **model_cfg):
    """open_clip_config.json as open_clip's push_to_hf_hub writes it: the model config as in
    open_clip's model_configs/*.json ("quick_gelu" only in the -quickgelu ones) + preprocess_cfg."""
    cfg = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 8},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 1}, **model_cfg}
    if quick_gelu is not None:
        cfg["quick_gelu"] = quick_gelu
    return {"model_cfg": cfg, "preprocess_cfg": {"mean": list(data.CLIP_MEAN), "std": list(data.CLIP_STD)}}


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny il_clip run (GELU preset) and its weights as a bare OpenAI-layout file."""
    root = tmp_path_factory.mktemp("act")
    assert M.main(TINY + ["--out_dir", str(root / "run")]) == 0
    bare = root / "bare" / "w.safetensors"
    os.makedirs(bare.parent)
    shutil.copy(root / "run" / "checkpoint" / "model.safetensors", bare)
    return root


def test_weights_activation_reads_each_layout(tmp_path):
    w = str(tmp_path / "hub" / "open_clip_model.safetensors")
    write_json(tmp_path / "hub" / "open_clip_config.json", hub_config())
    assert lifecycle.weights_activation(None, w) == (False, str(tmp_path / "hub" / "open_clip_config.json"))
    write_json(tmp_path / "hub" / "open_clip_config.json", hub_config(quick_gelu=True))
    assert lifecycle.weights_activation(None, w)[0] is True
    assert lifecycle.weights_activation(False, w) == (False, "flag")
    # the LAION repos also hold transformers' config.json: open_clip's file is read first
    write_json(tmp_path / "hub" / "config.json", {"architectures": ["CLIPModel"], "model": None})
    assert lifecycle.weights_activation(None, w)[1].endswith("open_clip_config.json")
    # a bare open_clip model config (open_clip reads it too), this repo's run config, neither
    write_json(tmp_path / "oc" / "config.json", hub_config()["model_cfg"])
    assert lifecycle.weights_activation(None, str(tmp_path / "oc" / "w.pt"))[0] is False
    write_json(tmp_path / "run" / "config.json", {"model": {"quick_gelu": False}})
    assert lifecycle.weights_activation(None, str(tmp_path / "run" / "model.safetensors"))[0] is False
    write_json(tmp_path / "other" / "config.json", {"architectures": ["CLIPModel"]})
    assert lifecycle.weights_activation(None, str(tmp_path / "other" / "w.safetensors")) == (True, "assumed")
    # a run that assumed it passes the assumption on, never as a statement
    write_json(tmp_path / "assumed" / "config.json", {"model": {"quick_gelu": True}, "quick_gelu_source": "assumed"})
    assert lifecycle.weights_activation(None, str(tmp_path / "assumed" / "w.safetensors")) == (True, "assumed")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "open_clip_config.json").write_text("{not json")
    with pytest.raises(data.DataError, match="open_clip_config.json: malformed JSON"):
        lifecycle.weights_activation(None, str(tmp_path / "bad" / "w.safetensors"))


def _run_config(out_dir):
    return lifecycle.read_json(os.path.join(out_dir, "checkpoint", "config.json"))


def test_il_clip_init_records_where_the_activation_came_from(trained, tmp_path, capsys):
    bare = str(trained / "bare" / "w.safetensors")
    capsys.readouterr()
    assert M.main(TINY + ["--init", bare, "--out_dir", str(tmp_path / "a")]) == 0
    cfg = _run_config(tmp_path / "a")
    assert cfg["model"]["quick_gelu"] is True and cfg["quick_gelu_source"] == "assumed"
    assert "assuming OpenAI's QuickGELU" in capsys.readouterr().err
    assert M.main(TINY + ["--init", bare, "--no-quick_gelu", "--out_dir", str(tmp_path / "f")]) == 0
    cfg = _run_config(tmp_path / "f")
    assert cfg["model"]["quick_gelu"] is False and cfg["quick_gelu_source"] == "flag"
    hub = tmp_path / "hub"
    os.makedirs(hub)
    shutil.copy(bare, hub / "open_clip_model.safetensors")
    conf = write_json(hub / "open_clip_config.json", hub_config())
    assert M.main(TINY + ["--init", str(hub / "open_clip_model.safetensors"), "--out_dir", str(tmp_path / "h")]) == 0
    cfg = _run_config(tmp_path / "h")
    assert cfg["model"]["quick_gelu"] is False and cfg["quick_gelu_source"] == conf
    assert not any(ln.startswith("note:") for ln in error_lines(capsys.readouterr().err))   # none on the activation
    # from scratch: the preset's own
    assert _run_config(trained / "run")["quick_gelu_source"] == "preset"


def test_load_model_and_eval_follow_the_file_and_repeat_an_assumption(trained, tmp_path, capsys):
    bare = str(trained / "bare" / "w.safetensors")
    x = torch.randn(2, 3, 32, 32)
    ref, _, _ = M.load_model(bare, quick_gelu=False)          # heads by OpenAI's width // 64, GELU
    hub = tmp_path / "hub"
    os.makedirs(hub)
    shutil.copy(bare, hub / "open_clip_model.safetensors")
    conf = write_json(hub / "open_clip_config.json", hub_config())
    model, _, config = M.load_model(str(hub / "open_clip_model.safetensors"))
    assert config["model"]["quick_gelu"] is False and config["quick_gelu_source"] == conf
    with torch.no_grad():
        assert torch.equal(model.encode_image(x), ref.encode_image(x))
        assert not torch.equal(M.load_model(bare, quick_gelu=True)[0].encode_image(x), ref.encode_image(x))
    capsys.readouterr()
    model, _, config = M.load_model(bare)
    assert config["model"]["quick_gelu"] is True and config["quick_gelu_source"] == "assumed"
    assert "assuming OpenAI's QuickGELU" in capsys.readouterr().err
    # a run that assumed it: load_model (so eval) says so again, and eval's JSON records it
    assert M.main(TINY + ["--init", bare, "--out_dir", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    assert E.main(["--ckpt", str(tmp_path / "a"), "--benchmarks", "spectral", "--no_progress",
                   "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "its run assumed OpenAI's QuickGELU" in err and "activation QuickGELU (assumed)" in err
    assert json.loads((tmp_path / "r.json").read_text())["quick_gelu_source"] == "assumed"
    # eval --init on open_clip's layout, with OpenAI's vocabulary (EOT = the last id)
    cfg = M.ModelConfig(embed_dim=32, image_size=32, patch_size=8, vision_width=64, vision_layers=1, vision_heads=1,
                        context_length=77, vocab_size=49408, text_width=64, text_layers=1, text_heads=1)
    save_file({k: v.contiguous() for k, v in M.CLIP(cfg).state_dict().items()},
              str(hub / "open_clip_model.safetensors"))
    vocab = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "bpe_simple_vocab_16e6.txt.gz")
    assert E.main(["--init", str(hub / "open_clip_model.safetensors"), "--vocab", vocab, "--benchmarks", "spectral",
                   "--no_progress", "--out", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert f"activation GELU ({conf})" in err and "note:" not in err
    blob = json.loads((tmp_path / "r.json").read_text())
    assert blob["quick_gelu"] is False and blob["quick_gelu_source"] == conf


def test_mm_learngene_teacher_reads_the_hub_config(trained, tmp_path, capsys):
    hub = tmp_path / "hub"
    os.makedirs(hub)
    shutil.copy(trained / "bare" / "w.safetensors", hub / "open_clip_model.safetensors")
    for d in (hub, trained / "bare"):
        shutil.copy(trained / "run" / "checkpoint" / "tokenizer.json", d)
    w = str(hub / "open_clip_model.safetensors")
    for stated in (False, True):
        write_json(hub / "open_clip_config.json", hub_config(quick_gelu=stated or None))
        assert MM.load_teacher(w)[2].quick_gelu is stated
    assert MM.load_teacher(w, quick_gelu=False)[2].quick_gelu is False
    capsys.readouterr()
    assert MM.load_teacher(str(trained / "bare" / "w.safetensors"))[2].quick_gelu is True
    assert "assuming OpenAI's QuickGELU" in capsys.readouterr().err
    assert MM.load_teacher(str(trained / "run"))[2].quick_gelu is False        # the run's config.json


def test_composer_clip_features_read_the_hub_config_and_take_the_flag(trained, tmp_path, capsys):
    cfg = M.ModelConfig(embed_dim=32, image_size=32, patch_size=8, vision_width=64, vision_layers=1, vision_heads=1,
                        vocab_size=100, text_width=64, text_layers=1, text_heads=1)
    sd = {k: v.contiguous() for k, v in M.CLIP(cfg).state_dict().items()}
    for d in ("hub", "bare"):
        os.makedirs(tmp_path / d)
        save_file(sd, str(tmp_path / d / "open_clip_model.safetensors"))
    w = str(tmp_path / "hub" / "open_clip_model.safetensors")
    write_json(tmp_path / "hub" / "open_clip_config.json", hub_config())
    assert C.load_clip_vision(w)[2] is False
    assert C.load_clip_vision(w, quick_gelu=True)[2] is True
    capsys.readouterr()
    assert C.load_clip_vision(str(tmp_path / "bare" / "open_clip_model.safetensors"))[2] is True
    assert "assuming OpenAI's QuickGELU" in capsys.readouterr().err
    assert C.load_clip_vision(str(trained / "run"))[2] is False                 # the run's config.json
    # --quick_gelu / --no-quick_gelu on the subcommands that take --features (train, eval)
    import argparse
    p = argparse.ArgumentParser()
    C.add_features(p)
    assert p.parse_args(["--no-quick_gelu"]).quick_gelu is False and p.parse_args([]).quick_gelu is None


def test_open_clip_models_built_from_the_hub_config_load_with_their_activation(tmp_path):
    """open_clip builds its CLIP from the fixture's "model_cfg" (GELU without "quick_gelu", as
    its LAION ViT-B-32; QuickGELU with it): il_clip.load_model, given no flag, reads the same
    file and gives open_clip's image embeddings."""
    from conftest import import_open_clip
    import_open_clip()
    from open_clip.model import CLIP
    x = torch.randn(2, 3, 32, 32)
    for quick in (False, True):
        hub = hub_config(quick_gelu=quick or None)
        torch.manual_seed(0)
        ref = CLIP(**hub["model_cfg"]).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.02 * torch.randn_like(p))      # no zero biases: the activation matters
        d = tmp_path / str(quick)
        d.mkdir()
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(d / "open_clip_model.safetensors"))
        write_json(d / "open_clip_config.json", hub)
        model, _, config = M.load_model(str(d / "open_clip_model.safetensors"))
        assert config["model"]["quick_gelu"] is quick
        with torch.no_grad():
            want = torch.nn.functional.normalize(ref.encode_image(x), dim=-1)
            assert torch.allclose(model.encode_image(x), want, atol=1e-5), quick
