"""Image feature extractors for the distribution metrics, loaded from local files only.

- :func:`load_inception`: the standard FID Inception-v3 (TensorFlow's 2015-12-05 graph as ported
  by torch-fidelity and wrapped by torchmetrics), from a weights file the user supplies. The file
  is read with ``torch.load(weights_only=True)`` (or safetensors), its keys and shapes are checked
  against the network, and only then does the network receive the tensors: torch-fidelity's own
  loader unpickles the file with ``weights_only=False``, which we never do on a user's file.
- :func:`load_encoder`: any other image encoder directory (DINOv2 ``AutoModel``, a CLIP model or
  its vision tower) for the Fréchet distance in its features (Stein et al. 2023, "Exposing flaws
  of generative model evaluation metrics", who recommend DINOv2 ViT-L/14).
- :func:`load_clip`: a CLIP model directory and its processor, for torchmetrics' ``CLIPScore``.

Every extractor has a ``fingerprint`` (its weights' sha256 and its preprocessing): cached
reference features are keyed by it.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from latentforge.errors import UserError

INCEPTION_SIZE = 299  # the input side of the FID Inception-v3
INCEPTION_FEATURES = (64, 192, 768, 2048)  # its pooled feature layers; FID/KID use 2048
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def clean_resize(image: Image.Image, size: int) -> np.ndarray:
    """clean-fid's "clean" resize (Parmar et al. 2022, "On Aliased Resizing and Surprising Subtleties
    in GAN Evaluation"): PIL bicubic, per channel in float32, to ``size`` x ``size``; then rounded to
    uint8 (the TF-ported Inception takes uint8), which moves a pixel by at most 0.5/255. HWC uint8."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32)
    channels = [np.asarray(Image.fromarray(arr[:, :, c], mode="F").resize((size, size), Image.Resampling.BICUBIC))
                for c in range(3)]
    return np.clip(np.stack(channels, axis=-1), 0, 255).round().astype(np.uint8)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A flat {name: tensor} from .safetensors or a torch file, never unpickling code."""
    if not path.is_file():
        raise UserError(f"{path}: weights file not found")
    try:
        if path.suffix == ".safetensors":
            import safetensors.torch

            sd = safetensors.torch.load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unreadable file is the same user error: say what it is not
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: not a weights file readable with weights_only=True ({first[:160]})") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in sd.items()):
        raise UserError(f"{path}: not a state dict (a mapping of names to tensors)")
    return sd


def _mismatch(expected: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> str | None:
    """One phrase describing how ``given`` differs from ``expected`` in keys and shapes, or None."""
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    shapes = [k for k in expected if k in given and tuple(given[k].shape) != tuple(expected[k].shape)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing tensors (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[0]})")
    if shapes:
        k = shapes[0]
        parts.append(f"{len(shapes)} of another shape (e.g. {k}: {tuple(given[k].shape)} in the file, "
                     f"{tuple(expected[k].shape)} in the network)")
    return "; ".join(parts) or None


def _inception_class():
    from torchmetrics.image.fid import NoTrainInceptionV3

    class VerifiedInceptionV3(NoTrainInceptionV3):
        """torchmetrics' Inception-v3 whose weights are checked against the architecture before loading."""

        source = "weights"

        def load_state_dict(self, state_dict, strict=True, assign=False):
            problem = _mismatch(self.state_dict(), state_dict)
            if problem:
                raise UserError(f"{self.source}: not the FID Inception-v3 weights (pt_inception-2015-12-05): {problem}")
            return super().load_state_dict(state_dict, strict=True, assign=assign)

    return VerifiedInceptionV3


class InceptionExtractor:
    """The FID Inception-v3 on PIL images: clean resize to 299, then the pooled features of one layer."""

    def __init__(self, weights: str | Path, feature: int = 2048, device: str | torch.device = "cpu"):
        if feature not in INCEPTION_FEATURES:
            raise UserError(f"inception feature layer {feature}: must be one of {INCEPTION_FEATURES}")
        path = Path(weights)
        state = _read_state_dict(path)
        # torch-fidelity's constructor reads the weights with torch.load(weights_only=False); it gets
        # an in-memory copy of the tensors read above (plain tensors, no code), never the user's file.
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        cls = _inception_class()
        cls.source = str(path)
        self.net = cls(name="inception-v3-compat", features_list=[str(feature)], feature_extractor_weights_path=buf)
        self.device = torch.device(device)
        self.net.to(self.device)
        self.feature = feature
        self.dim = feature
        self.name = "inception" if feature == 2048 else f"inception{feature}"
        self.fingerprint = {"extractor": "inception-v3-compat", "weights_sha256": sha256_file(path),
                            "feature": feature, "resize": f"clean (PIL bicubic, float) to {INCEPTION_SIZE}"}

    @torch.no_grad()
    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor:
        x = np.stack([clean_resize(im, INCEPTION_SIZE) for im in images])
        x = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().to(self.device)
        return self.net(x).float().cpu()


def _weight_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def _directory_fingerprint(root: Path, kind: str) -> dict[str, Any]:
    files = _weight_files(root)
    if not files:
        raise UserError(f"{root}: no weights file (*.safetensors / *.bin) in this model directory")
    proc = root / "preprocessor_config.json"
    return {"extractor": kind, "weights_sha256": {p.name: sha256_file(p) for p in files},
            "preprocessor": json.loads(proc.read_text()) if proc.exists() else None}


def _model_config(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise UserError(f"{root}: no such model directory")
    cfg = root / "config.json"
    if not cfg.exists():
        raise UserError(f"{root}: not a transformers model directory (no config.json)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{cfg}: not valid JSON") from None


class EncoderExtractor:
    """A transformers image encoder directory: DINOv2 (the normed CLS token, as in Stein et al.'s
    dgm-eval), a CLIP model (its projected image embedding) or any model with a ``pooler_output``.
    Inputs are prepared by the directory's own image processor (its resize and normalisation)."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu"):
        from transformers import AutoImageProcessor, AutoModel

        root = Path(path)
        config = _model_config(root)
        self.model_type = config.get("model_type", "")
        if not (root / "preprocessor_config.json").exists():
            raise UserError(f"{root}: no preprocessor_config.json (the encoder's image processor) in this directory")
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(root), local_files_only=True)
            self.model = AutoModel.from_pretrained(str(root), local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{root}: cannot load the image encoder ({str(e).splitlines()[0][:160]})") from None
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        self.name = root.resolve().name
        self.fingerprint = _directory_fingerprint(root, f"transformers:{self.model_type}")
        self.dim = int(self(  # one black image: the feature dimension (and a check that the model runs)
            [Image.new("RGB", (32, 32))]).shape[1])

    @torch.no_grad()
    def __call__(self, images: Sequence[Image.Image]) -> torch.Tensor:
        pixels = self.processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.device)
        if self.model_type == "clip":
            out = self.model.get_image_features(pixel_values=pixels)
            feats = out if torch.is_tensor(out) else out.pooler_output  # transformers 5: a ModelOutput
        else:
            out = self.model(pixel_values=pixels)
            feats = getattr(out, "pooler_output", None)
            if feats is None:
                feats = out.last_hidden_state[:, 0]
        if feats.ndim != 2:
            feats = feats.flatten(1)
        return feats.float().cpu()


class _TensorCLIP(torch.nn.Module):
    """A ``CLIPModel`` whose ``get_*_features`` return the embedding tensor, as torchmetrics'
    ``CLIPScore`` expects (transformers 5 returns a ModelOutput whose ``pooler_output`` holds it)."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model
        self.config = model.config

    @staticmethod
    def _tensor(out: Any) -> torch.Tensor:
        return out if torch.is_tensor(out) else out.pooler_output

    def get_image_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_text_features(*args, **kwargs))


def load_clip(path: str | Path) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """(model, processor, fingerprint) of a local CLIP directory, for torchmetrics' CLIPScore."""
    from transformers import CLIPModel, CLIPProcessor

    root = Path(path)
    config = _model_config(root)
    if config.get("model_type") != "clip":
        raise UserError(f"{root}: not a CLIP model directory (model_type {config.get('model_type')!r}, expected 'clip')")
    try:
        model = CLIPModel.from_pretrained(str(root), local_files_only=True).eval()
        processor = CLIPProcessor.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{root}: cannot load the CLIP model and its processor ({str(e).splitlines()[0][:160]})") from None
    return _TensorCLIP(model), processor, _directory_fingerprint(root, "clip")
