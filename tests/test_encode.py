"""The encode step: latents and text embeddings against direct model calls, resume, rejects, errors."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch
from diffusers import AutoencoderKL
from PIL import Image
from transformers import AutoModel, AutoTokenizer

from latentforge import storage
from latentforge.config import from_dict, load_config
from latentforge.data.encode import EMPTY_PROMPT, REJECTED, SUMMARY, EncodeConfig, TextCache, encode_dataset
from latentforge.data.schema import decode_value, read_index, read_shard
from latentforge.errors import ConfigError, UserError
from latentforge.models.autoencoder import AutoencoderConfig, build_vae, load_vae, vae_fingerprint
from latentforge.models.text import encode_text, load_text_encoder
from s3_server import new_bucket, start_moto, use_endpoint
from tiny_models import make_raw_dataset, make_tiny_bert, make_tiny_clip, make_tiny_t5, make_tiny_vae

RES = 32  # pixels; the tiny VAE downsamples 2x -> 16x16 latents
MAX_LEN = 16  # tokens; the tiny BERT has 32 positions
COLOURS_12 = ("red", "yellow", "green", "cyan", "blue", "purple") * 2
SHAPES_12 = ("circle", "square", "triangle", "star", "cross", "diamond", "star", "cross", "diamond", "circle",
             "square", "triangle")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("assets")
    return {
        "vae": make_tiny_vae(root / "vae"),
        "vae_other": make_tiny_vae(root / "vae_other", seed=1),
        "bert": make_tiny_bert(root / "bert"),
        "clip": make_tiny_clip(root / "clip"),
        "t5": make_tiny_t5(root / "t5"),
        "raw": make_raw_dataset(root / "raw", n=40, resolution=RES, num_shards=3),
    }


def _cfg(assets, text: str = "bert", **kw) -> EncodeConfig:
    base = dict(vae=str(assets["vae"]), text_encoder=str(assets[text]), max_length=MAX_LEN, batch_size=8,
                device="cpu")
    return EncodeConfig(**{**base, **kw})


def _rows(root: Path) -> list[dict]:
    """Every sample of a latent dataset, decoded with the column types of its index."""
    index = read_index(str(root))
    rows = []
    for shard in index.shards:
        table = read_shard(str(root / shard.name)).to_pylist()
        rows += [{k: decode_value(v, index.columns[k]) for k, v in r.items()} for r in table]
    return rows


def _raw_samples(raw: Path) -> list[dict]:
    index = read_index(str(raw))
    return [r for s in index.shards for r in read_shard(str(raw / s.name)).to_pylist()]


def _pixels(png: bytes) -> torch.Tensor:
    """Decoded independently of the encode module: RGB, [-1, 1], NCHW."""
    rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32)
    return torch.from_numpy(rgb / 127.5 - 1.0).permute(2, 0, 1)[None]


@pytest.fixture(scope="module")
def bert_out(assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("enc") / "bert"
    summary = encode_dataset(str(assets["raw"]), str(out), _cfg(assets), progress=False)
    assert summary == {"seen": 40, "written": 40, "rejected": {}}
    return out


def test_index_describes_latents_text_and_vae(assets, bert_out):
    index = read_index(str(bert_out))
    raw = read_index(str(assets["raw"]))
    assert index.kind == "latent"
    assert [s.name for s in index.shards] == [s.name for s in raw.shards]
    assert [s.num_samples for s in index.shards] == [s.num_samples for s in raw.shards]
    assert index.columns == {
        "key": "str", "caption": "str", "width": "int64", "height": "int64",
        "latent_mean": "ndarray:float16:4,16,16", "latent_std": "ndarray:float16:4,16,16",
        "text_hidden": "ndarray:float16:16,16", "text_mask": "ndarray:uint8:16", "text_pooled": "ndarray:float16:16",
    }
    meta = index.meta
    assert meta["resolution"] == RES
    # The tiny VAE's factors are not Stable Diffusion's 0.18215: they must come from its config.
    assert meta["vae"]["scaling_factor"] == 0.5 and meta["vae"]["shift_factor"] == pytest.approx(0.1)
    assert meta["vae"]["latent_channels"] == 4 and meta["vae"]["downsample_factor"] == 2
    assert meta["vae"]["fingerprint"] == vae_fingerprint(str(assets["vae"]))
    assert meta["text_encoder"]["pooled_output"] == "pooler_output"
    assert meta["text_encoder"]["max_length"] == MAX_LEN
    assert len(meta["source_dataset"]["fingerprint"]) == 64
    assert json.loads((bert_out / SUMMARY).read_text()) == {"seen": 40, "written": 40, "rejected": {}}
    assert (bert_out / REJECTED).read_text() == ""
    saved = load_config(EncodeConfig, bert_out / "encode_config.yaml")
    assert saved.max_length == MAX_LEN and saved.text_dtype == "float32" and saved.tokenizer == str(assets["bert"])


def test_local_model_paths_are_recorded_absolute(assets, tmp_path, monkeypatch):
    """Given relative to the working directory, the VAE and text encoder are recorded absolute:
    a run trained, sampled or exported from another directory finds them again."""
    monkeypatch.chdir(assets["vae"].parent)
    out = tmp_path / "enc"
    encode_dataset(str(assets["raw"]), str(out), _cfg(assets, vae="vae", text_encoder="./bert"), progress=False)
    meta = read_index(str(out)).meta
    assert meta["vae"]["path"] == str(assets["vae"].resolve())
    assert meta["text_encoder"]["path"] == meta["text_encoder"]["tokenizer_path"] == str(assets["bert"].resolve())


def test_latents_match_a_direct_vae_forward(assets, bert_out):
    rows = _rows(bert_out)
    raw = _raw_samples(assets["raw"])
    assert [r["key"] for r in rows] == [r["key"] for r in raw]
    assert [r["caption"] for r in rows] == [r["caption"] for r in raw]
    vae = AutoencoderKL.from_pretrained(assets["vae"], use_safetensors=True, low_cpu_mem_usage=False)
    for i in (0, 13, 39):  # first, second shard, last (in a partial batch)
        with torch.no_grad():
            dist = vae.encode(_pixels(raw[i]["image"])).latent_dist
        for name, direct in (("latent_mean", dist.mean), ("latent_std", dist.std)):
            stored = rows[i][name].astype(np.float32)  # float16 storage: about 3 significant digits
            np.testing.assert_allclose(stored, direct[0].numpy(), rtol=1e-3, atol=1e-3)
    means = np.stack([r["latent_mean"] for r in rows])
    assert np.unique(means.reshape(len(rows), -1), axis=0).shape[0] == len(rows)  # every image its own latent


def _direct_text(path: Path, captions: list[str]):
    model = AutoModel.from_pretrained(path, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(path)
    t = tok(captions, padding="max_length", truncation=True, max_length=MAX_LEN, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
    return out, t["attention_mask"]


def test_text_matches_a_direct_encoder_call(assets, bert_out):
    rows = _rows(bert_out)
    out, mask = _direct_text(assets["bert"], [r["caption"] for r in rows])
    hidden = np.stack([r["text_hidden"] for r in rows]).astype(np.float32)
    np.testing.assert_allclose(hidden, out.last_hidden_state.numpy(), rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(np.stack([r["text_mask"] for r in rows]), mask.numpy())
    pooled = np.stack([r["text_pooled"] for r in rows]).astype(np.float32)
    np.testing.assert_allclose(pooled, out.pooler_output.numpy(), rtol=2e-3, atol=2e-3)
    assert 0 < mask.sum(1).min() and mask.sum(1).max() < MAX_LEN  # real padding in every caption


def test_empty_prompt_file(assets, bert_out):
    empty = safetensors.numpy.load_file(bert_out / EMPTY_PROMPT)
    assert {k: (v.dtype.name, v.shape) for k, v in empty.items()} == {
        "text_hidden": ("float16", (MAX_LEN, 16)),
        "text_mask": ("uint8", (MAX_LEN,)),
        "text_pooled": ("float16", (16,)),
    }
    out, mask = _direct_text(assets["bert"], [""])
    np.testing.assert_allclose(empty["text_hidden"].astype(np.float32), out.last_hidden_state[0].numpy(),
                               atol=2e-3, rtol=2e-3)
    np.testing.assert_array_equal(empty["text_mask"], mask[0].numpy())
    assert empty["text_mask"].sum() == 2  # [CLS] [SEP]
    np.testing.assert_allclose(empty["text_pooled"].astype(np.float32), out.pooler_output[0].numpy(),
                               atol=2e-3, rtol=2e-3)


def test_clip_text_encoder_stores_pooled_output(assets, tmp_path):
    out = tmp_path / "clip"
    encode_dataset(str(assets["raw"]), str(out), _cfg(assets, "clip", storage_dtype="float32"), progress=False)
    index = read_index(str(out))
    assert index.columns["text_pooled"] == "ndarray:float32:16"
    assert index.columns["latent_mean"] == "ndarray:float32:4,16,16"
    assert index.meta["text_encoder"]["class"] == "CLIPTextModel"
    rows = _rows(out)
    direct, _ = _direct_text(assets["clip"], [r["caption"] for r in rows])
    for name, expected in (("text_hidden", direct.last_hidden_state), ("text_pooled", direct.pooler_output)):
        np.testing.assert_allclose(np.stack([r[name] for r in rows]), expected.numpy(), atol=1e-5)


def test_t5_encoder_has_no_pooled_column(assets, tmp_path):
    model, tok = load_text_encoder(str(assets["t5"]), tokenizer=str(assets["bert"]))
    assert type(model).__name__ == "T5EncoderModel"  # the decoder of the saved T5Model is not loaded
    assert set(encode_text(model, tok, ["a red circle"], MAX_LEN)) == {"text_hidden", "text_mask"}
    out = tmp_path / "t5"
    cfg = _cfg(assets, "t5", tokenizer=str(assets["bert"]))
    encode_dataset(str(assets["raw"]), str(out), cfg, progress=False)
    index = read_index(str(out))
    assert "text_pooled" not in index.columns and index.meta["text_encoder"]["pooled_output"] is None
    assert set(safetensors.numpy.load_file(out / EMPTY_PROMPT)) == {"text_hidden", "text_mask"}


def test_resume_recomputes_only_missing_shards(assets, tmp_path):
    out = tmp_path / "out"
    encode_dataset(str(assets["raw"]), str(out), _cfg(assets), progress=False)
    shards = sorted(out.glob("shard-*.parquet"))
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in shards}
    index_before = json.loads((out / "index.json").read_text())
    victim = shards[1]
    victim.unlink()
    (out / ".progress" / f"{victim.name}.json").unlink()

    summary = encode_dataset(str(assets["raw"]), str(out), _cfg(assets), progress=False)
    assert summary == {"seen": 40, "written": 40, "rejected": {}}
    for p in shards:
        mtime, data = before[p.name]
        assert p.read_bytes() == data
        assert (p.stat().st_mtime_ns == mtime) == (p != victim), p.name
    assert json.loads((out / "index.json").read_text()) == index_before


def test_resume_refuses_other_inputs(assets, tmp_path):
    out = tmp_path / "out"
    encode_dataset(str(assets["raw"]), str(out), _cfg(assets), progress=False)
    with pytest.raises(UserError, match=r"vae\.fingerprint"):
        encode_dataset(str(assets["raw"]), str(out), _cfg(assets, vae=str(assets["vae_other"])), progress=False)
    with pytest.raises(UserError, match=r"text_encoder\.max_length"):
        encode_dataset(str(assets["raw"]), str(out), _cfg(assets, max_length=12), progress=False)
    with pytest.raises(UserError, match="storage_dtype"):
        encode_dataset(str(assets["raw"]), str(out), _cfg(assets, storage_dtype="float32"), progress=False)
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("mine")
    with pytest.raises(UserError) as err:
        encode_dataset(str(assets["raw"]), str(unrelated), _cfg(assets), progress=False)
    assert str(err.value) == (f"{unrelated}: exists, is not empty and holds no encode output (no .progress/meta.json): "
                              "use a new or empty directory")
    assert sorted(p.name for p in unrelated.iterdir()) == ["notes.txt"]


def test_missing_or_damaged_raw_shards_stop_before_any_work(assets, tmp_path):
    raw = Path(shutil.copytree(assets["raw"], tmp_path / "raw"))
    shards = [s.name for s in read_index(str(raw)).shards]
    (raw / shards[-1]).unlink()
    with pytest.raises(UserError, match=rf"1 shard\(s\) listed in index.json are missing \({shards[-1]}\)"):
        encode_dataset(str(raw), str(tmp_path / "out"), _cfg(assets), progress=False)
    assert not (tmp_path / "out").exists()
    (raw / shards[-1]).write_bytes(b"garbage")
    with pytest.raises(UserError, match=rf"{shards[-1]}: not a readable parquet shard"):
        encode_dataset(str(raw), str(tmp_path / "out"), _cfg(assets), progress=False)


def test_unreachable_object_storage_is_one_line(assets, tmp_path, monkeypatch, capsys):
    """No credentials for s3:// (botocore's own error deep in a read): one line and exit code 2."""
    from botocore.exceptions import NoCredentialsError

    from latentforge.cli import main

    def no_credentials(uri: str) -> bool:
        raise NoCredentialsError()

    monkeypatch.setattr(storage, "exists", no_credentials)
    assert main(["encode", "s3://bucket/raw", "--vae", str(assets["vae"]), "--text-encoder", str(assets["bert"]),
                 "--out", str(tmp_path / "out"), "--quiet", f"encode.max_length={MAX_LEN}"]) == 2
    assert capsys.readouterr().err == "latentforge: error: object storage: Unable to locate credentials\n"


def test_damaged_images_are_rejected_and_counted(assets, tmp_path):
    raw = make_raw_dataset(tmp_path / "raw", n=20, resolution=RES, num_shards=2, bad_images=(3, 14))
    out = tmp_path / "out"
    summary = encode_dataset(str(raw), str(out), _cfg(assets), progress=False)
    assert summary == {"seen": 20, "written": 18, "rejected": {"undecodable_image": 2}}
    assert json.loads((out / SUMMARY).read_text()) == summary
    rejected = [json.loads(line) for line in (out / REJECTED).read_text().splitlines()]
    assert [(r["key"], r["reason"]) for r in rejected] == [("test/000003", "undecodable_image"),
                                                           ("test/000014", "undecodable_image")]
    keys = [r["key"] for r in _rows(out)]
    assert len(keys) == 18 and "test/000003" not in keys and "test/000014" not in keys
    assert read_index(str(out)).num_samples == 18
    # A rerun keeps the counts of the finished shards (and does not duplicate rejects).
    assert encode_dataset(str(raw), str(out), _cfg(assets), progress=False) == summary
    assert len((out / REJECTED).read_text().splitlines()) == 2


def test_bad_model_paths_are_one_line_user_errors(assets, tmp_path):
    raw = str(assets["raw"])
    cases = [
        (_cfg(assets, vae=str(tmp_path / "missing")), "no such directory"),
        (_cfg(assets, vae=str(assets["bert"])), "not a diffusers AutoencoderKL"),
        (_cfg(assets, vae=str(assets["raw"])), "no config.json"),
        (_cfg(assets, text_encoder=str(assets["vae"])), "text encoder config"),
        (_cfg(assets, text_encoder=str(assets["t5"])), "no tokenizer_config.json"),
    ]
    for cfg, message in cases:
        with pytest.raises(UserError, match=message) as e:
            encode_dataset(raw, str(tmp_path / "out"), cfg, progress=False)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="not a latentforge dataset"):
        encode_dataset(str(tmp_path), str(tmp_path / "out"), _cfg(assets), progress=False)
    for text, kind in (("[1, 2]", "list"), ('"hello"', "str"), ("null", "NoneType")):  # JSON, not an object: was AttributeError
        (tmp_path / "index.json").write_text(text)
        with pytest.raises(UserError, match=rf"index.json: holds a JSON {kind}, not a dataset index; rerun the ingest"):
            encode_dataset(str(tmp_path), str(tmp_path / "out"), _cfg(assets), progress=False)


def test_loading_a_text_encoder_draws_no_loading_bar_and_leaves_the_bars_as_they_were(assets, capfd):
    """transformers draws a bar for every model it loads (the demo loads MiniLM eight times): off
    while the encoder loads, back on afterwards when it was on."""
    from transformers.utils import logging as transformers_logging

    from latentforge.models.text import load_text_encoder

    was = transformers_logging.is_progress_bar_enabled()
    try:
        for on in (True, False):
            (transformers_logging.enable_progress_bar if on else transformers_logging.disable_progress_bar)()
            capfd.readouterr()
            load_text_encoder(str(assets["bert"]))
            assert "Loading weights" not in capfd.readouterr().err
            assert transformers_logging.is_progress_bar_enabled() is on
    finally:
        (transformers_logging.enable_progress_bar if was else transformers_logging.disable_progress_bar)()


def test_config_validation():
    cfg = from_dict(EncodeConfig, {"text_encoder": "t"})  # a recipe may leave the VAE to --vae
    with pytest.raises(ConfigError, match="^encode.vae: required"):
        cfg.require_models()
    with pytest.raises(ConfigError, match="^batch_size"):
        from_dict(EncodeConfig, {"vae": "v", "text_encoder": "t", "batch_size": 0})
    with pytest.raises(ConfigError, match="^storage_dtype"):
        from_dict(EncodeConfig, {"vae": "v", "text_encoder": "t", "storage_dtype": "int8"})
    cfg = from_dict(EncodeConfig, {"vae": "v", "text_encoder": "t", "max_length": None})
    assert cfg.max_length is None and cfg.storage_dtype == "float16"


def test_captions_longer_than_max_length_are_counted(assets, tmp_path):
    """A caption past the encoder's max_length is kept whole in the shard and counted in the
    summary (its embedding sees the first max_length tokens)."""
    long = "a red circle " + "on a very long wooden table " * 4
    tok = AutoTokenizer.from_pretrained(assets["bert"])
    assert len(tok("a small blue square")["input_ids"]) <= MAX_LEN < len(tok(long)["input_ids"])
    raw = make_raw_dataset(tmp_path / "raw", n=6, resolution=RES, num_shards=2,
                           captions=["a small blue square", long, "a small blue square"])
    summary = encode_dataset(str(raw), str(tmp_path / "out"), _cfg(assets), progress=False)
    assert summary == {"seen": 6, "written": 6, "rejected": {}, "truncated_captions": 2}
    assert json.loads((tmp_path / "out" / SUMMARY).read_text()) == summary
    assert sum(r["caption"] == long for r in _rows(tmp_path / "out")) == 2


def test_max_length_is_checked_against_the_encoder(assets, tmp_path):
    with pytest.raises(ConfigError, match="max_length: 77 exceeds .* 32 positions"):
        encode_dataset(str(assets["raw"]), str(tmp_path / "out"), _cfg(assets, max_length=77), progress=False)


def test_tiny_tokenizers_really_tokenize(assets):
    clip = AutoTokenizer.from_pretrained(assets["clip"])
    tokens = clip.convert_ids_to_tokens(clip("a small red circle in the top left")["input_ids"])
    assert tokens == ["<|startoftext|>", "a</w>", "small</w>", "red</w>", "circle</w>", "in</w>", "the</w>",
                      "top</w>", "left</w>", "<|endoftext|>"]
    bert = AutoTokenizer.from_pretrained(assets["bert"])
    assert bert.convert_ids_to_tokens(bert("a red zebra")["input_ids"]) == ["[CLS]", "a", "red", "[UNK]", "[SEP]"]


def test_build_vae_from_config():
    cfg = AutoencoderConfig(block_out_channels=(8, 16, 16), layers_per_block=1, latent_channels=3,
                            norm_num_groups=4, sample_size=32, scaling_factor=0.7)
    vae = build_vae(cfg)
    with torch.no_grad():
        z = vae.encode(torch.zeros(1, 3, 32, 32)).latent_dist.mean
    assert z.shape == (1, 3, 8, 8) and vae.config.scaling_factor == 0.7
    with pytest.raises(ConfigError, match="^norm_num_groups"):
        from_dict(AutoencoderConfig, {"block_out_channels": [8, 12], "norm_num_groups": 8})
    with pytest.raises(ConfigError, match="^sample_size"):
        from_dict(AutoencoderConfig, {"block_out_channels": [8, 16, 16], "norm_num_groups": 4, "sample_size": 30})


def test_vae_fingerprint_follows_the_weights_not_the_storage_dtype(assets, tmp_path):
    vae = load_vae(str(assets["vae"]))
    vae.half().save_pretrained(tmp_path / "half")
    half_fp = vae_fingerprint(str(tmp_path / "half"))
    assert half_fp == vae_fingerprint(vae)  # same values, loaded as float32 or kept as float16
    assert half_fp != vae_fingerprint(str(assets["vae"]))  # rounding to float16 changed the weights
    assert vae_fingerprint(str(assets["vae"])) != vae_fingerprint(str(assets["vae_other"]))


@pytest.fixture(scope="module")
def moto_endpoint():
    url, stop = start_moto()
    yield url
    stop()


def test_encode_reads_raw_shards_from_s3(assets, bert_out, moto_endpoint, monkeypatch, tmp_path):
    use_endpoint(moto_endpoint, monkeypatch)
    bucket = new_bucket()
    for f in sorted(assets["raw"].iterdir()):
        storage.write_bytes(f"s3://{bucket}/raw/{f.name}", f.read_bytes())
    out = tmp_path / "out"
    encode_dataset(f"s3://{bucket}/raw", str(out), _cfg(assets), progress=False)
    for shard in read_index(str(bert_out)).shards:
        assert (out / shard.name).read_bytes() == (bert_out / shard.name).read_bytes()


def test_a_repeated_caption_is_encoded_once_across_shards_and_after_a_resume(assets, tmp_path, monkeypatch):
    """The text encoder sees each distinct caption once per encode (the rows written before are
    remembered across batches and shards); a resumed encode remembers the finished shards' rows
    and writes the same bytes; the output matches a direct encoder call."""
    from latentforge.data import encode as encode_module

    captions = [f"a {s} {c} {shape}" for s, c, shape in zip(("small", "large") * 6, COLOURS_12, SHAPES_12)]
    raw = make_raw_dataset(tmp_path / "raw", n=30, resolution=RES, num_shards=3, captions=captions)
    tok = AutoTokenizer.from_pretrained(assets["bert"])
    ids = {c: tuple(t) for c, t in zip(captions, tok(captions, padding="max_length", max_length=MAX_LEN,
                                                      truncation=True)["input_ids"])}
    assert len(set(ids.values())) == 12
    empty = tuple(tok([""], padding="max_length", max_length=MAX_LEN)["input_ids"][0])
    seen: list[tuple[int, ...]] = []
    real = encode_module.encode_tokens

    def recording(model, tokens):
        seen.extend(tuple(r) for r in tokens["input_ids"].tolist())
        return real(model, tokens)

    monkeypatch.setattr(encode_module, "encode_tokens", recording)
    out = tmp_path / "out"
    assert encode_dataset(str(raw), str(out), _cfg(assets), progress=False)["written"] == 30
    assert sorted(r for r in seen if r != empty) == sorted(ids.values())  # shards of 10, batches of 8, 12 captions
    rows = _rows(out)
    direct, _ = _direct_text(assets["bert"], [r["caption"] for r in rows])
    np.testing.assert_allclose(np.stack([r["text_hidden"] for r in rows]).astype(np.float32),
                               direct.last_hidden_state.numpy(), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(np.stack([r["text_pooled"] for r in rows]).astype(np.float32),
                               direct.pooler_output.numpy(), rtol=2e-3, atol=2e-3)

    # the middle shard lost: its rows 10-19 hold captions 10, 11, 0-7, of which only 10 and 11 are new
    before = {p.name: p.read_bytes() for p in out.glob("shard-*.parquet")}
    (out / "shard-000001.parquet").unlink()
    (out / ".progress" / "shard-000001.parquet.json").unlink()
    seen.clear()
    assert encode_dataset(str(raw), str(out), _cfg(assets), progress=False)["written"] == 30
    assert sorted(r for r in seen if r != empty) == sorted([ids[captions[10]], ids[captions[11]]])
    assert {p.name: p.read_bytes() for p in out.glob("shard-*.parquet")} == before

    # off: each batch encodes its own distinct captions, to the same values
    seen.clear()
    encode_dataset(str(raw), str(tmp_path / "off"), _cfg(assets, text_cache_mb=0), progress=False)
    assert len([r for r in seen if r != empty]) > 12
    for a, b in zip(_rows(out), _rows(tmp_path / "off")):
        np.testing.assert_allclose(a["text_hidden"].astype(np.float32), b["text_hidden"].astype(np.float32),
                                   rtol=1e-3, atol=1e-3)


def test_text_cache_keeps_what_fits_and_never_evicts():
    row = {"text_hidden": np.zeros((4, 8), np.float16), "text_mask": np.ones(4, np.uint8)}  # 64 + 4 bytes
    cache = TextCache(max_bytes=2 * 68 + 10)
    view = np.arange(16, dtype=np.float16).reshape(2, 8)
    cache.add(b"a", {**row, "text_hidden": np.repeat(view, 2, axis=0)})
    cache.add(b"a", row)  # known: unchanged
    assert cache.entries[b"a"]["text_hidden"][0, 1] == 1 and not cache.full
    cache.add(b"b", row)
    cache.add(b"c", row)  # does not fit: the cache is full, "a" and "b" stay
    assert list(cache.entries) == [b"a", b"b"] and cache.full and cache.nbytes == 136
    cache.add(b"d", row)
    assert list(cache.entries) == [b"a", b"b"]
    assert TextCache(0).full


def test_values_that_overflow_float16_are_rejected(assets, tmp_path, monkeypatch):
    from latentforge.data import encode as encode_module

    circle = AutoTokenizer.from_pretrained(assets["bert"]).convert_tokens_to_ids("circle")  # word-level vocabulary
    encode_tokens = encode_module.encode_tokens

    def overflowing(model, tokens):  # what a float16 overflow of a large encoder looks like
        out = encode_tokens(model, tokens)
        scale = torch.where((tokens["input_ids"] == circle).any(dim=1), 1e6, 1.0)[:, None, None]
        return {**out, "text_hidden": out["text_hidden"] * scale}

    monkeypatch.setattr(encode_module, "encode_tokens", overflowing)
    num_circles = sum("circle" in r["caption"] for r in _raw_samples(assets["raw"]))
    assert 0 < num_circles < 40
    summary = encode_dataset(str(assets["raw"]), str(tmp_path / "out"), _cfg(assets), progress=False)
    assert summary == {"seen": 40, "written": 40 - num_circles, "rejected": {"non_finite": num_circles}}


def test_reader_thread_keeps_order_and_counts_rejects(assets, tmp_path):
    """Batches of 2, decoded and tokenised ahead in the reader thread, damaged images at the edges of
    batches and shards and whole damaged batches (6-7, and 29 alone at the end of the second shard):
    every kept row carries its own image's latents and its own caption's text."""
    bad = (0, 6, 7, 8, 12, 29)
    raw = make_raw_dataset(tmp_path / "raw", n=30, resolution=RES, num_shards=2, bad_images=bad)
    out = tmp_path / "out"
    summary = encode_dataset(str(raw), str(out), _cfg(assets, batch_size=2), progress=False)
    assert summary == {"seen": 30, "written": 24, "rejected": {"undecodable_image": 6}}
    rejected = [json.loads(line)["key"] for line in (out / REJECTED).read_text().splitlines()]
    assert rejected == [f"test/{i:06d}" for i in bad]
    rows, samples = _rows(out), [s for i, s in enumerate(_raw_samples(raw)) if i not in bad]
    assert [r["key"] for r in rows] == [s["key"] for s in samples]
    vae = AutoencoderKL.from_pretrained(assets["vae"], use_safetensors=True, low_cpu_mem_usage=False)
    with torch.no_grad():
        direct = vae.encode(torch.cat([_pixels(s["image"]) for s in samples])).latent_dist.mean
    np.testing.assert_allclose(np.stack([r["latent_mean"] for r in rows]).astype(np.float32), direct.numpy(),
                               rtol=1e-3, atol=1e-3)
    text, _ = _direct_text(assets["bert"], [s["caption"] for s in samples])
    np.testing.assert_allclose(np.stack([r["text_hidden"] for r in rows]).astype(np.float32),
                               text.last_hidden_state.numpy(), rtol=2e-3, atol=2e-3)


def test_ahead_yields_in_order_within_its_depth_and_raises_in_place():
    from concurrent.futures import Future

    from latentforge.data.encode import _ahead

    class Recorder:  # a pool that runs each call at once and records when it was asked for
        submitted: list[int] = []

        def submit(self, fn, item):
            self.submitted.append(item)
            f = Future()
            try:
                f.set_result(fn(item))
            except Exception as e:
                f.set_exception(e)
            return f

    def work(i):
        if i == 4:
            raise ValueError("item 4")
        return i * 10

    pool = Recorder()
    it = _ahead(pool, work, range(6), depth=2)
    assert pool.submitted == []  # nothing before the first request
    assert next(it) == 0 and pool.submitted == [0, 1, 2]  # two ahead of the consumer, never more
    assert next(it) == 10 and pool.submitted == [0, 1, 2, 3]
    assert [next(it), next(it)] == [20, 30]
    with pytest.raises(ValueError, match="item 4"):  # where item 4 is due, not earlier
        next(it)


def test_a_rejection_message_is_the_same_in_every_run():
    """Pillow names an unreadable in-memory file by its address ("<_io.BytesIO object at 0x...>"),
    which differs between runs; the ledger must not, so that two runs write the same rejected.jsonl."""
    from latentforge.data.encode import RejectedImage, decode_image

    messages = set()
    for _ in range(2):
        with pytest.raises(RejectedImage, match="cannot identify image file") as e:
            decode_image(b"this is not an image", RES)
        messages.add(str(e.value))
    assert len(messages) == 1 and " at 0x" not in messages.pop()
