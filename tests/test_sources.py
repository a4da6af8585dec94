"""Sources of the ingest: image folders, WebDataset tars, img2dataset/HF parquet; local and S3 (moto)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from latentforge import storage
from latentforge.config import from_dict
from latentforge.data.sources import SourceConfig, WorkUnit, iter_records, plan_units
from latentforge.errors import ConfigError, UserError
from s3_server import new_bucket, start_moto, use_endpoint


@pytest.fixture(scope="session")
def moto_endpoint():
    url, stop = start_moto()
    yield url
    stop()


@pytest.fixture
def s3_endpoint(moto_endpoint, monkeypatch):
    return use_endpoint(moto_endpoint, monkeypatch)


def image_bytes(fmt: str = "PNG", color: tuple[int, int, int] = (200, 30, 30), size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format=fmt)
    return buf.getvalue()


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def read_all(sources: list[str], cfg: SourceConfig | None = None):
    cfg = cfg or SourceConfig()
    units, stats = plan_units([str(s) for s in sources], cfg)
    recs = [r for u in units for r in iter_records(u, cfg)]
    keys = [r.key for r in recs]
    assert len(keys) == len(set(keys)), "keys must be unique within a run"
    return recs, units, stats


def by_key(recs) -> dict:
    return {r.key: r for r in recs}


def add_member(tf: tarfile.TarFile, name: str, data: bytes | str = b"", kind: bytes = tarfile.REGTYPE,
               linkname: str = "") -> None:
    data = data.encode() if isinstance(data, str) else data
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tf.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def make_tar(path: Path, members: list[tuple], mode: str = "w") -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode) as tf:
        for m in members:
            add_member(tf, *m)
    return path.read_bytes()


# ---------------------------------------------------------------- image folders


@pytest.fixture
def txt_folder(tmp_path: Path) -> Path:
    root = tmp_path / "imgs"
    write(root / "a/b/x.jpg", image_bytes("JPEG"))
    write(root / "a/b/x.txt", "a red square\n")
    write(root / "y.PNG", image_bytes("PNG", (0, 0, 255)))
    write(root / "y.txt", "a blue square")
    write(root / "z.webp", image_bytes("WEBP"))  # no caption
    write(root / "notes.md", "not data")
    write(root / "orphan.txt", "a caption without an image")
    write(root / ".DS_Store", b"\0")
    write(root / "._y.PNG", b"macOS resource fork")
    return root


def test_folder_with_txt_captions(txt_folder: Path):
    recs, units, stats = read_all([txt_folder])
    assert [u.kind for u in units] == ["files"]
    got = by_key(recs)
    assert sorted(got) == ["imgs/a/b/x.jpg", "imgs/y.PNG", "imgs/z.webp"]
    x = got["imgs/a/b/x.jpg"]
    assert x.caption == "a red square\n" and x.error is None
    assert x.image == (txt_folder / "a/b/x.jpg").read_bytes()
    assert x.source == str(txt_folder / "a/b/x.jpg")
    assert got["imgs/y.PNG"].caption == "a blue square"
    z = got["imgs/z.webp"]
    assert z.caption is None and z.error is None and z.image  # the ingest rejects it as no_caption
    assert stats["files"]["image"] == 3 and stats["files"]["caption"] == 2
    assert stats["ignored_files"] == 4  # notes.md, orphan.txt, .DS_Store, ._y.PNG
    assert stats["ignored_by_ext"] == {"(hidden)": 2, ".md": 1, ".txt": 1}
    assert stats["expected_records"] == len(recs) == 3


def test_folder_non_utf8_caption_and_empty_image(tmp_path: Path):
    root = tmp_path / "f"
    write(root / "bad.png", image_bytes())
    write(root / "bad.txt", b"caf\xe9 au lait")  # latin-1
    write(root / "empty.png", b"")
    write(root / "empty.txt", "an empty file")
    got = by_key(read_all([root])[0])
    assert got["f/bad.png"].error == "caption_decode_error" and got["f/bad.png"].image is None
    assert got["f/empty.png"].error == "empty_file"


def test_metadata_jsonl(tmp_path: Path):
    root = tmp_path / "hf"
    write(root / "train/0001.png", image_bytes())
    write(root / "train/0002.png", image_bytes(color=(1, 2, 3)))
    write(root / "train/0003.png", image_bytes(color=(4, 5, 6)))
    write(root / "train/0003.txt", "caption from the txt file")
    rows = [
        {"file_name": "train/0001.png", "text": "one", "license": "CC-BY-4.0", "aesthetic_score": 6.5,
         "tags": ["a", "b"], "blob": "x" * 5000},
        {"file_name": "train/0002.png", "caption": "two", "aesthetic_score": 4},
        {"file_name": "train/gone.png", "text": "its file was deleted"},
    ]
    write(root / "metadata.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    recs, units, stats = read_all([root], SourceConfig(license="CC0-1.0"))
    got = by_key(recs)
    one = got["hf/train/0001.png"]
    assert (one.caption, one.license, one.error) == ("one", "CC-BY-4.0", None)
    assert one.meta == {"aesthetic_score": 6.5, "tags": ["a", "b"]}  # the 5000-char blob is left out
    two = got["hf/train/0002.png"]
    assert (two.caption, two.license, two.meta) == ("two", "CC0-1.0", {"aesthetic_score": 4})
    assert got["hf/train/0003.png"].caption == "caption from the txt file"
    gone = got["hf/train/gone.png"]
    assert gone.error == "missing_file" and gone.image is None
    assert stats["metadata_rows"] == 3 and stats["missing_files"] == 1
    assert stats["files"]["metadata"] == 1 and stats["ignored_files"] == 0
    assert len(recs) == stats["expected_records"] == 4


def test_metadata_csv(tmp_path: Path):
    root = tmp_path / "csvset"
    write(root / "sub/meta_imgs/a.jpg", image_bytes("JPEG"))
    write(root / "sub/meta_imgs/b.jpg", image_bytes("JPEG", (9, 9, 9)))
    write(root / "sub/metadata.csv",
          'file_name,text,license,aesthetic_score,source_id\n'
          'meta_imgs/a.jpg,"a cat, sitting",CC-BY-SA-4.0,5.25,17\n'
          'meta_imgs/b.jpg,1984,,,\n')
    got = by_key(read_all([root])[0])
    a = got["csvset/sub/meta_imgs/a.jpg"]
    assert (a.caption, a.license) == ("a cat, sitting", "CC-BY-SA-4.0")
    assert a.meta == {"aesthetic_score": 5.25, "source_id": 17}  # numbers, so numeric filters work
    b = got["csvset/sub/meta_imgs/b.jpg"]
    assert b.caption == "1984" and b.license == "" and b.meta == {"aesthetic_score": None, "source_id": None}


@pytest.mark.parametrize("content, match", [
    ('{"file_name": "a.png", "text": "x"}\nnot json\n', "line 2: not valid JSON"),
    ('{"text": "x"}\n', "no file_name"),
    ('{"file_name": 5, "text": "x"}\n', "file_name 5 is not a path string"),
    ('{"file_name": "a.png"}\n{"file_name": "./a.png"}\n', "already described"),
])
def test_malformed_metadata_is_a_user_error(tmp_path: Path, content: str, match: str):
    write(tmp_path / "d/a.png", image_bytes())
    write(tmp_path / "d/metadata.jsonl", content)
    with pytest.raises(UserError, match=match):
        plan_units([str(tmp_path / "d")], SourceConfig())


def test_folder_chunks_are_deterministic(tmp_path: Path):
    root = tmp_path / "many"
    for i in range(7):
        write(root / f"{i:02d}.png", image_bytes(color=(i, i, i)))
        write(root / f"{i:02d}.txt", f"image {i}")
    cfg = SourceConfig(folder_chunk=3)
    units, _ = plan_units([str(root)], cfg)
    assert [len(u.items) for u in units] == [3, 3, 1]
    assert units == plan_units([str(root)], cfg)[0]
    ids = [u.unit_id() for u in units]
    assert len(set(ids)) == 3 and ids[0].startswith(f"files:{root}#0@")
    keys = [r.key for u in units for r in iter_records(u, cfg)]
    assert keys == [f"many/{i:02d}.png" for i in range(7)]
    write(root / "00b.png", image_bytes())  # a new image shifts the chunks: other unit ids, a new plan
    assert [u.unit_id() for u in plan_units([str(root)], cfg)[0]][0] != ids[0]


# ---------------------------------------------------------------- WebDataset tars


def test_webdataset_tar(tmp_path: Path):
    jpg = image_bytes("JPEG")
    path = tmp_path / "shards/00000.tar"
    make_tar(path, [
        ("000000000.jpg", jpg),
        ("000000000.txt", "a txt caption"),
        ("000000000.json", json.dumps({"url": "http://x", "caption": "ignored: txt wins", "width": 8})),
        ("./sub/000000001.png", image_bytes()),
        ("./sub/000000001.json", json.dumps({"text": "a json caption", "license": "CC-BY-4.0", "exif": "e" * 4000})),
        ("../evil.txt", "escape"),
        ("/abs.jpg", jpg),
        ("link.jpg", "", tarfile.SYMTYPE, "/etc/passwd"),
        ("000000002.txt", "a caption without image"),
        ("000000002.cls", "3"),
        ("000000003.seg.png", image_bytes()),  # webdataset key "000000003", extension "seg.png"
        ("000000003.webp", image_bytes("WEBP")),
        ("000000004.jpg", jpg),
        ("000000004.json", b'{"caption": '),
    ])
    recs, units, stats = read_all([tmp_path / "shards"], SourceConfig(license="CC0-1.0"))
    assert [u.unit_id() for u in units] == [f"tar:{path}"]
    got = by_key(recs)
    s0 = got["shards/00000/000000000"]
    assert (s0.image, s0.caption, s0.license, s0.error) == (jpg, "a txt caption", "CC0-1.0", None)
    assert s0.meta == {"url": "http://x", "width": 8} and s0.source == f"{path}#000000000.jpg"
    s1 = got["shards/00000/sub/000000001"]
    assert (s1.caption, s1.license, s1.meta) == ("a json caption", "CC-BY-4.0", {})
    unsafe = [r for r in recs if r.error == "unsafe_path"]
    assert sorted(r.source.split("#", 1)[1] for r in unsafe) == ["../evil.txt", "/abs.jpg", "link.jpg"]
    assert all(r.image is None for r in unsafe)
    s2 = got["shards/00000/000000002"]
    assert s2.error == "no_image" and s2.caption is None
    s3 = got["shards/00000/000000003"]
    assert s3.error is None and s3.meta == {"ignored_members": ["000000003.seg.png"]}
    assert got["shards/00000/000000004"].error == "meta_decode_error"
    assert len(recs) == 5 + 3


def test_tar_repeated_key_is_another_sample(tmp_path: Path):
    path = tmp_path / "r.tar"
    make_tar(path, [("a.png", image_bytes()), ("b.png", image_bytes()), ("a.png", image_bytes(color=(0, 0, 0)))])
    assert [r.key for r in read_all([path])[0]] == ["r/a", "r/b", "r/a~2"]


def test_truncated_tar(tmp_path: Path):
    members = [(f"{i:03d}.{ext}", image_bytes(color=(i, 0, 0), size=32) if ext == "png" else f"caption {i}")
               for i in range(4) for ext in ("png", "txt")]
    full = make_tar(tmp_path / "full.tar", members)
    with tarfile.open(tmp_path / "full.tar") as tf:
        offsets = {m.name: m.offset for m in tf.getmembers()}
    cases = {
        "mid_data": offsets["002.png"] + 700,  # inside the image of sample 2
        "mid_header": offsets["002.txt"] + 100,  # inside a member header: tarfile alone stops silently
        "no_end_blocks": offsets["003.png"],  # a writer that died between members
    }
    for name, cut in cases.items():
        (tmp_path / f"{name}.tar").write_bytes(full[:cut])
        recs, _, _ = read_all([tmp_path / f"{name}.tar"])
        ok = [r for r in recs if r.error is None]
        assert [r.key for r in ok] == [f"{name}/000", f"{name}/001"], name
        assert [r.error for r in recs[len(ok):]] == ["source_error"], name
        assert "full.tar" not in recs[-1].detail and f"{name}.tar" in recs[-1].detail
    complete = read_all([tmp_path / "full.tar"])[0]
    assert [r.error for r in complete] == [None] * 4


def test_not_a_tar_and_gzip(tmp_path: Path):
    write(tmp_path / "junk.tar", b"this is not a tar archive at all" * 40)
    recs = read_all([tmp_path / "junk.tar"])[0]
    assert [(r.key, r.error) for r in recs] == [("junk/#source_error", "source_error")]
    make_tar(tmp_path / "z.tar.gz", [("k.png", image_bytes()), ("k.txt", "gz caption")], mode="w:gz")
    recs = read_all([tmp_path / "z.tar.gz"])[0]
    assert [(r.key, r.caption, r.error) for r in recs] == [("z/k", "gz caption", None)]
    data = (tmp_path / "z.tar.gz").read_bytes()
    (tmp_path / "cut.tgz").write_bytes(data[: len(data) // 2])
    assert [r.error for r in read_all([tmp_path / "cut.tgz"])[0]] == ["source_error"]


# ---------------------------------------------------------------- parquet


def img2dataset_table(n: int) -> pa.Table:
    ok = [i % 3 != 2 for i in range(n)]
    return pa.table({
        "key": [f"{i:09d}" for i in range(n)],
        "url": [f"http://example.com/{i}.jpg" for i in range(n)],
        "caption": [f"caption {i}" for i in range(n)],
        "status": ["success" if k else "failed_to_download" for k in ok],
        "error_message": [None if k else "HTTP 404" for k in ok],
        "width": pa.array([8 if k else None for k in ok], pa.int32()),
        "height": pa.array([8 if k else None for k in ok], pa.int32()),
        "sha256": [f"{i:064x}" for i in range(n)],
        "exif": ["{}" for _ in range(n)],
        "aesthetic_score": [5.0 + i / 10 for i in range(n)],
        "LICENSE": ["CC-BY-4.0" if i == 0 else None for i in range(n)],
        "jpg": pa.array([image_bytes("JPEG", (i, i, i)) if k else None for i, k in enumerate(ok)], pa.binary()),
    })


def test_img2dataset_parquet(tmp_path: Path):
    table = img2dataset_table(7)
    (tmp_path / "laion").mkdir()
    pq.write_table(table, tmp_path / "laion/00000.parquet", row_group_size=3)
    cfg = SourceConfig(license="unknown-web")
    recs, units, stats = read_all([tmp_path / "laion"], cfg)
    assert [u.unit_id() for u in units] == [f"parquet:{tmp_path / 'laion/00000.parquet'}"]
    assert stats["parquet_rows"] == stats["expected_records"] == 7 == len(recs)
    assert [r.key for r in recs] == [f"laion/00000/{i}" for i in range(7)]
    r0 = recs[0]
    assert r0.image == table["jpg"][0].as_py() and r0.caption == "caption 0" and r0.license == "CC-BY-4.0"
    assert r0.meta == {"key": "000000000", "url": "http://example.com/0.jpg", "width": 8, "height": 8,
                       "sha256": f"{0:064x}", "exif": "{}", "aesthetic_score": 5.0}
    assert r0.source.endswith("00000.parquet#row=0")
    assert recs[1].license == "unknown-web"
    failed = [r for r in recs if r.error]
    assert [(r.key, r.error, r.detail) for r in failed] == [
        ("laion/00000/2", "download_failed", "HTTP 404"), ("laion/00000/5", "download_failed", "HTTP 404")]
    # Split at row-group boundaries: the same records, in the same order, with the same keys.
    split_cfg = SourceConfig(parquet_unit_rows=4)
    split_units, _ = plan_units([str(tmp_path / "laion")], split_cfg)
    assert [u.row_groups for u in split_units] == [(0, 1), (2,)]
    split = [r for u in split_units for r in iter_records(u, split_cfg)]
    assert [(r.key, r.image, r.error) for r in split] == [(r.key, r.image, r.error) for r in recs]


def test_parquet_hf_struct_and_paths(tmp_path: Path):
    png = image_bytes()
    write(tmp_path / "ds/images/a.png", png)
    write(tmp_path / "elsewhere/b.png", png + b"b")
    pq.write_table(pa.table({
        "image": pa.array([{"bytes": png, "path": None}, {"bytes": None, "path": "images/a.png"},
                           {"bytes": None, "path": None}],
                          pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "text": ["s0", "s1", "s2"],
    }), write(tmp_path / "ds/hf.parquet", b""))
    got = read_all([tmp_path / "ds/hf.parquet"])[0]
    assert [(r.key, r.image, r.caption, r.error) for r in got] == [
        ("hf/0", png, "s0", None), ("hf/1", png, "s1", None), ("hf/2", None, None, "no_image")]
    pq.write_table(pa.table({
        "file_name": ["images/a.png", str(tmp_path / "elsewhere/b.png"), "images/missing.png"],
        "TEXT": ["p0", "p1", "p2"],
        "punsafe": [0.1, 0.2, 0.3],
    }), tmp_path / "ds/paths.parquet")
    got = read_all([tmp_path / "ds/paths.parquet"])[0]
    # An absolute path outside the parquet's folder is refused (test_path_rule_* below).
    assert [(r.image, r.caption, r.error) for r in got] == [(png, "p0", None), (None, None, "outside_source"),
                                                          (None, None, "missing_file")]
    assert got[0].meta == {"punsafe": 0.1}


def test_parquet_columns_must_be_found(tmp_path: Path):
    pq.write_table(pa.table({"jpg": [b"x"], "alt": ["c"]}), tmp_path / "nocap.parquet")
    with pytest.raises(UserError, match="no caption column.*set caption_column"):
        plan_units([str(tmp_path / "nocap.parquet")], SourceConfig())
    recs = read_all([tmp_path / "nocap.parquet"], SourceConfig(caption_column="alt"))[0]
    assert [(r.image, r.caption) for r in recs] == [(b"x", "c")]
    with pytest.raises(UserError, match="no column 'pixels'"):
        plan_units([str(tmp_path / "nocap.parquet")], SourceConfig(image_column="pixels", caption_column="alt"))
    pq.write_table(pa.table({"n": [1], "caption": ["c"]}), tmp_path / "noimg.parquet")
    with pytest.raises(UserError, match="no image column"):
        plan_units([str(tmp_path / "noimg.parquet")], SourceConfig())
    write(tmp_path / "broken.parquet", b"PAR1 not really")
    with pytest.raises(UserError, match="not a readable parquet"):
        plan_units([str(tmp_path / "broken.parquet")], SourceConfig())


def test_parquet_truncated_after_planning_counts_every_row(tmp_path: Path):
    path = tmp_path / "t.parquet"
    pq.write_table(img2dataset_table(6), path, row_group_size=2)
    cfg = SourceConfig()
    units, _ = plan_units([str(path)], cfg)
    data = path.read_bytes()
    with pq.ParquetFile(path) as pf:  # corrupt the last row group's data, keep the footer
        start = pf.metadata.row_group(2).column(0).file_offset
    path.write_bytes(data[:start] + b"\xff" * 64 + data[start + 64:])
    recs = list(iter_records(units[0], cfg))
    assert [r.key for r in recs] == [f"t/{i}" for i in range(6)]
    assert [r.error for r in recs[4:]] == ["source_error", "source_error"]


# ---------------------------------------------------------------- planning


def test_mixed_directory_reads_one_kind(tmp_path: Path):
    root = tmp_path / "out"
    make_tar(root / "00000.tar", [("a.jpg", image_bytes("JPEG")), ("a.txt", "cap")])
    pq.write_table(img2dataset_table(2), write(root / "00000.parquet", b""))  # img2dataset's sidecar
    write(root / "00000_stats.json", "{}")
    units, stats = plan_units([str(root)], SourceConfig())
    assert [u.kind for u in units] == ["tar"]
    assert stats["ignored_files"] == 2 and stats["ignored_by_ext"] == {".json": 1, ".parquet": 1}
    assert "read as tar files only" in stats["notes"][0]
    assert stats["expected_records"] is None  # a tar's sample count is known only once read
    json.dumps(stats)  # the listing goes into summary.json


def test_source_errors_and_names(tmp_path: Path, txt_folder: Path):
    with pytest.raises(UserError, match="no such file"):
        plan_units([str(tmp_path / "nope")], SourceConfig())
    write(tmp_path / "docs/readme.md", "x")
    with pytest.raises(UserError, match="no images"):
        plan_units([str(tmp_path / "docs")], SourceConfig())
    with pytest.raises(UserError, match="not a .tar"):
        plan_units([str(tmp_path / "docs/readme.md")], SourceConfig())
    with pytest.raises(UserError, match="sources overlap"):
        plan_units([str(txt_folder), str(txt_folder / "a")], SourceConfig())
    other = tmp_path / "other/imgs"
    shutil.copytree(txt_folder, other)
    units, stats = plan_units([str(txt_folder), str(other)], SourceConfig())
    assert [s["name"] for s in stats["sources"]] == ["imgs", "imgs-2"]
    assert {u.name for u in units} == {"imgs", "imgs-2"}


def test_config_validation():
    with pytest.raises(ConfigError, match="folder_chunk"):
        from_dict(SourceConfig, {"folder_chunk": 0})
    with pytest.raises(ConfigError, match="caption_ext"):
        from_dict(SourceConfig, {"caption_ext": ".jpg"})
    with pytest.raises(ConfigError, match="image_column"):
        from_dict(SourceConfig, {"image_column": ""})
    assert from_dict(SourceConfig, {"caption_ext": ".caption"}).caption_ext == ".caption"


def test_unknown_unit_kind_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown work unit kind 'zip'"):
        iter_records(WorkUnit("zip", "x.zip", "x"), SourceConfig())


# ---------------------------------------------------------------- S3 (a real local moto server)


def upload_dir(local: Path, bucket: str, prefix: str) -> str:
    client = storage.s3_client()
    for f in sorted(local.rglob("*")):
        if f.is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{f.relative_to(local).as_posix()}", Body=f.read_bytes())
    return f"s3://{bucket}/{prefix}"


def comparable(recs) -> list[tuple]:
    return [(r.key, r.image, r.caption, r.license, r.meta, r.error) for r in recs]


def test_s3_sources_match_local(s3_endpoint, tmp_path: Path, txt_folder: Path):
    bucket = new_bucket()
    # An image folder with captions and metadata.
    write(txt_folder / "metadata.jsonl", json.dumps({"file_name": "z.webp", "text": "meta", "license": "MIT"}) + "\n"
          + json.dumps({"file_name": "gone.png", "text": "t"}) + "\n")
    s3_folder = upload_dir(txt_folder, bucket, "data/imgs")
    # A tar with a refused member and a truncated copy of it.
    tar = make_tar(tmp_path / "shards/000.tar", [("k0.jpg", image_bytes("JPEG")), ("k0.txt", "c0"),
                                                 ("../x.txt", "no"), ("k1.png", image_bytes()), ("k1.txt", "c1")])
    with tarfile.open(tmp_path / "shards/000.tar") as tf:
        cut = tf.getmember("k1.png").offset_data + 100  # inside the image of the second sample
    write(tmp_path / "cut/000.tar", tar[:cut])
    s3_shards = upload_dir(tmp_path / "shards", bucket, "shards")
    s3_cut = upload_dir(tmp_path / "cut", bucket, "cut") + "/000.tar"
    # Parquet with bytes (several row groups, read by ranged GETs) and with relative paths.
    pq_dir = tmp_path / "pq"
    pq_dir.mkdir()
    pq.write_table(img2dataset_table(5), pq_dir / "part-0.parquet", row_group_size=2)
    write(tmp_path / "pqp/images/a.png", image_bytes())
    pq.write_table(pa.table({"path": ["images/a.png", "images/nope.png"], "caption": ["a", "b"]}),
                   tmp_path / "pqp/paths.parquet")
    s3_pq = upload_dir(pq_dir, bucket, "pq")
    s3_pqp = upload_dir(tmp_path / "pqp", bucket, "pqp") + "/paths.parquet"

    local_sources = [txt_folder, tmp_path / "shards", tmp_path / "cut/000.tar", pq_dir, tmp_path / "pqp/paths.parquet"]
    s3_sources = [s3_folder, s3_shards, s3_cut, s3_pq, s3_pqp]
    local, _, local_stats = read_all(local_sources, SourceConfig(parquet_unit_rows=2))
    remote, units, s3_stats = read_all(s3_sources, SourceConfig(parquet_unit_rows=2))
    assert comparable(remote) == comparable(local)
    for key in ("files", "ignored_files", "metadata_rows", "missing_files", "parquet_rows"):
        assert s3_stats[key] == local_stats[key], key
    assert [u.unit_id() for u in units][1:4] == [f"tar:{s3_shards}/000.tar", f"tar:{s3_cut}",
                                                 f"parquet:{s3_pq}/part-0.parquet#rg=0-0"]
    got = by_key(remote)
    assert got["imgs/z.webp"].caption == "meta" and got["imgs/gone.png"].error == "missing_file"
    assert got["imgs/a/b/x.jpg"].source == f"{s3_folder}/a/b/x.jpg"
    assert [(r.key, r.error) for r in remote if r.key.startswith("000/")] == [
        ("000/../x.txt", "unsafe_path"), ("000/k0", None), ("000/k1", "source_error")]
    assert got["paths/1"].error == "missing_file" and got["paths/0"].image == image_bytes()
    with pytest.raises(UserError, match="no such file"):
        plan_units([f"s3://{bucket}/nothing-here"], SourceConfig())
    with pytest.raises(UserError, match="cannot list"):
        plan_units(["s3://no-such-bucket-xyz/p"], SourceConfig())


# ---------------------------------------------------------------- the path rule (confine)


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """Every address the sources read through storage.read_bytes / open_stream, in order."""
    seen: list[str] = []
    read, stream = storage.read_bytes, storage.open_stream
    monkeypatch.setattr(storage, "read_bytes", lambda uri: (seen.append(str(uri)), read(uri))[1])
    monkeypatch.setattr(storage, "open_stream", lambda uri: (seen.append(str(uri)), stream(uri))[1])
    return seen


@pytest.fixture
def outside(tmp_path: Path) -> dict[str, Path]:
    """Files outside every source: an image and a 'system file' that must never be opened."""
    return {"image": write(tmp_path / "outside/secret.png", image_bytes(color=(1, 99, 1))),
            "system": write(tmp_path / "outside/passwd", "root:x:0:0:secret\n")}


def test_path_rule_folder_refuses_symlinks_unless_followed(tmp_path: Path, outside, opened):
    root = tmp_path / "imgs"
    write(root / "ok.png", image_bytes())
    write(root / "ok.txt", "an image of its own")
    (root / "link.png").symlink_to(outside["image"])  # a link to an image outside the folder
    write(root / "link.txt", "caption of the link")
    (root / "sys.png").symlink_to(outside["system"])  # a link to a system file, named like an image
    write(root / "own.png", image_bytes(color=(5, 5, 5)))
    (root / "own.txt").symlink_to(outside["system"])  # a caption file linked to a system file
    (root / "inner.png").symlink_to(root / "ok.png")  # a link inside the folder: refused too by default
    got = by_key(read_all([root])[0])
    assert got["imgs/ok.png"].error is None and got["imgs/ok.png"].caption == "an image of its own"
    for key in ("imgs/link.png", "imgs/sys.png", "imgs/own.png", "imgs/inner.png"):
        assert (got[key].error, got[key].image, got[key].caption) == ("symlink", None, None), key
    assert "follow_symlinks" in got["imgs/sys.png"].detail
    assert str(outside["system"]) not in opened and str(outside["image"]) not in opened
    assert not [u for u in opened if u.endswith(("link.png", "sys.png", "own.txt", "inner.png"))]

    followed = by_key(read_all([root], SourceConfig(follow_symlinks=True))[0])
    assert followed["imgs/link.png"].image == outside["image"].read_bytes()
    assert followed["imgs/own.png"].caption == outside["system"].read_text()  # the user vouched for the link
    assert followed["imgs/inner.png"].image == image_bytes()


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_path_rule_metadata_file_name_stays_in_the_source(tmp_path: Path, outside, opened, kind):
    root = tmp_path / "hf"
    write(root / "train/a.png", image_bytes())
    names = ["train/a.png", "../outside/secret.png", str(outside["system"]), str(root / "train/b.png"),
             "train/../../outside/other.png", "train/link.png"]
    write(root / "train/b.png", image_bytes(color=(3, 3, 3)))
    (root / "train/link.png").symlink_to(outside["image"])
    if kind == "jsonl":
        write(root / "metadata.jsonl", "".join(json.dumps({"file_name": n, "text": f"c{i}"}) + "\n"
                                               for i, n in enumerate(names)))
    else:
        write(root / "metadata.csv", "file_name,text\n" + "".join(f"{n},c{i}\n" for i, n in enumerate(names)))
    recs, _, stats = read_all([root])
    errors = {r.source: r.error for r in recs}
    assert errors[str(root / "train/a.png")] is None
    assert errors[str(root / "train/b.png")] is None  # an absolute path inside the source is fine
    assert errors[str(root / "train/link.png")] == "symlink"
    refused = [r for r in recs if r.error == "outside_source"]
    assert len(refused) == 3 and all(r.image is None and r.caption is None for r in refused)
    assert len(recs) == stats["expected_records"] == 6 and stats["missing_files"] == 0
    assert not [u for u in opened if "outside" in u]


def test_path_rule_parquet_path_column_stays_in_the_source(tmp_path: Path, outside, opened):
    src = tmp_path / "ds"
    png = image_bytes()
    write(src / "images/a.png", png)
    (src / "images/link.png").symlink_to(outside["image"])
    pq.write_table(pa.table({
        "path": ["images/a.png", "../../outside/secret.png", str(outside["system"]), "images/link.png",
                 "images/../images/a.png", "s3://bucket/x.png", "../../../../../../../../etc/passwd"],
        "caption": [f"c{i}" for i in range(7)],
    }), write(src / "part/p.parquet", b""))
    # Named as a directory: the root is ds/, so ../images/a.png from part/ stays inside it.
    pq.write_table(pa.table({"path": ["../images/a.png", "../../outside/secret.png"], "caption": ["x", "y"]}),
                   src / "part/q.parquet")
    got = by_key(read_all([src])[0])
    assert [got[f"ds/part/p/{i}"].error for i in range(7)] == [
        "missing_file", "outside_source", "outside_source", "missing_file", "missing_file", "outside_source",
        "outside_source"]  # p.parquet's paths are relative to part/, where there are no images
    assert (got["ds/part/q/0"].image, got["ds/part/q/1"].error) == (png, "outside_source")
    # Named as a file: the root is its folder.
    pq.write_table(pa.table({"path": ["images/a.png", "../outside/secret.png", "images/link.png"],
                             "caption": ["a", "b", "c"]}), src / "top.parquet")
    got = read_all([src / "top.parquet"])[0]
    assert [(r.image, r.error) for r in got] == [(png, None), (None, "outside_source"), (None, "symlink")]
    assert not [u for u in opened if "outside" in u or u == "/etc/passwd"]


def test_path_rule_linked_tar_or_parquet_in_a_directory_is_one_rejected_record(tmp_path: Path, outside, opened):
    elsewhere = tmp_path / "elsewhere"
    make_tar(elsewhere / "0.tar", [("a.jpg", image_bytes("JPEG")), ("a.txt", "a")])
    make_tar(tmp_path / "shards/1.tar", [("b.jpg", image_bytes("JPEG")), ("b.txt", "b")])
    (tmp_path / "shards/0.tar").symlink_to(elsewhere / "0.tar")
    recs, units, stats = read_all([tmp_path / "shards"])
    assert [(r.key, r.error) for r in recs] == [("shards/0", "symlink"), ("shards/1/b", None)]
    assert [s["kind"] for s in stats["sources"]] == ["tar"]
    assert str(tmp_path / "shards/0.tar") not in opened
    recs = read_all([tmp_path / "shards"], SourceConfig(follow_symlinks=True))[0]
    assert [(r.key, r.error) for r in recs] == [("shards/0/a", None), ("shards/1/b", None)]
    # A file the user names is read even through a link: they named it.
    assert [r.error for r in read_all([tmp_path / "shards/0.tar"])[0]] == [None]


def test_path_rule_s3_keys_stay_under_the_prefix(s3_endpoint, tmp_path: Path):
    bucket, other = new_bucket(), new_bucket()
    client = storage.s3_client()
    put = lambda b, k, data: client.put_object(Bucket=b, Key=k, Body=data)
    png = image_bytes()
    put(bucket, "data/imgs/a.png", png)
    put(bucket, "data/imgs/a.txt", "a")
    put(bucket, "data/imgs/x/../../../secret/b.png", png)  # a key with '..': refused, even though it exists
    put(bucket, "data/imgs/x/../../../secret/b.txt", "b")
    put(bucket, "secret/s.png", image_bytes(color=(9, 9, 9)))
    put(other, "o.png", png)
    put(bucket, "data/imgs/metadata.jsonl", "".join(json.dumps(r) + "\n" for r in [
        {"file_name": "a.png", "text": "a"}, {"file_name": "../../secret/s.png", "text": "up"},
        {"file_name": f"s3://{other}/o.png", "text": "other bucket"},
        {"file_name": f"s3://{bucket}/secret/s.png", "text": "same bucket, outside the prefix"}]))
    recs = read_all([f"s3://{bucket}/data/imgs"])[0]
    errors = {r.source: r.error for r in recs}
    assert errors[f"s3://{bucket}/data/imgs/a.png"] is None
    assert errors[f"s3://{bucket}/data/imgs/x/../../../secret/b.png"] == "outside_source"
    assert [r.error for r in recs].count("outside_source") == 4 and len(recs) == 5
    put(bucket, "pq/images/c.png", png)
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"path": ["images/c.png", "../secret/s.png", f"s3://{other}/o.png",
                                      f"s3://{bucket}/secret/s.png", f"s3://{bucket}/pq/images/c.png", "/etc/passwd"],
                             "caption": list("abcdef")}), path)
    put(bucket, "pq/p.parquet", path.read_bytes())
    got = read_all([f"s3://{bucket}/pq/p.parquet"])[0]
    assert [r.error for r in got] == [None, "outside_source", "outside_source", "outside_source", None,
                                      "outside_source"]
