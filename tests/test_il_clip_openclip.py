"""Foreign weights load with their own activation (issue 15.2): open_clip's random ViT-B-32
(GELU) and ViT-B-32-quickgelu give open_clip's image and text embeddings through
il_clip.load_model and through --init, each with its --quick_gelu / --no-quick_gelu."""
import types

import pytest
import torch
from safetensors.torch import save_file

import il_clip as M
from conftest import import_open_clip


@pytest.mark.parametrize("name,quick_gelu", [("ViT-B-32", False), ("ViT-B-32-quickgelu", True)])
def test_open_clip_vit_b_32_embeddings_through_load_model_and_init(tmp_path, capsys, name, quick_gelu):
    open_clip = import_open_clip()
    torch.manual_seed(0)
    ref = open_clip.create_model(name, pretrained=None).eval()
    path = str(tmp_path / "w.safetensors")
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(2, 3, 224, 224, generator=g)
    text = torch.randint(1, 49000, (2, 77), generator=g)
    text[:, 0], text[0, 9:], text[1, 30:] = 49406, 0, 0
    text[0, 8], text[1, 29] = 49407, 49407
    with torch.no_grad():
        want = ref.encode_image(images, normalize=True), ref.encode_text(text, normalize=True)

    def check(model, close=True):
        with torch.no_grad():
            got = model.eval().encode_image(images), model.encode_text(text)
        errs = [(a - b).abs().max().item() for a, b in zip(got, want)]
        assert all(e < 1e-5 for e in errs) == close, errs

    check(M.load_model(path, quick_gelu=quick_gelu)[0])
    args = M.build_args(["--model", "ViT-B-32", "--method", "clip", "--init", path, "--data", "cc3m",
                         "--out_dir", str(tmp_path / "o")] + (["--quick_gelu"] if quick_gelu else ["--no-quick_gelu"]))
    tok = types.SimpleNamespace(vocab_size=49408, context_length=77, eot_id=49407)
    check(M.build_model_and_optimizer(args, M.model_config(args, tok), torch.device("cpu"))[0])
    if not quick_gelu:
        capsys.readouterr()
        # with no flag the default is OpenAI's QuickGELU, said on stderr: wrong for this GELU model
        check(M.load_model(path)[0], close=False)
        assert "QuickGELU" in capsys.readouterr().err
