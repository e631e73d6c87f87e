"""The fake hub driven by the real huggingface_hub client: snapshot and single-file
downloads, revisions, patterns, the offline cache, gated/private/missing repos, and a
download cut midway (fake_hub.py, conftest.py)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import httpx2
import huggingface_hub as hf
import pytest
from huggingface_hub import errors
from huggingface_hub.utils import enable_progress_bars

CHUNK = 10 * 1024 * 1024  # huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE
TINY_FILES = ["config.json", "model.safetensors", "original/params.json", "pytorch_model.bin",
              "tokenizer.json"]


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_same_files(snapshot: str, source: pathlib.Path) -> None:
    assert _files(pathlib.Path(snapshot)) == _files(source)


def test_snapshot_download_of_a_branch_with_progress_bars(
        fake_hub, hub_env, tiny_repo_dir, capfd, monkeypatch):
    sha = fake_hub.add_repo("org/tiny", tiny_repo_dir)
    monkeypatch.setenv("TQDM_POSITION", "-1")  # bars on although stderr is no terminal
    enable_progress_bars()
    path = hf.snapshot_download("org/tiny")  # endpoint and cache come from hub_env
    storage = hub_env.cache / "models--org--tiny"
    assert path == str(storage / "snapshots" / sha)
    _assert_same_files(path, tiny_repo_dir)
    assert (storage / "refs" / "main").read_text() == sha
    err = capfd.readouterr().err
    assert "Fetching 5 files" in err and "Download complete" in err
    # Listing once, then per file a HEAD (etag, size, commit) and a plain GET; no Xet.
    assert fake_hub.requests[:2] == [("GET", "/api/models/org/tiny/revision/main"),
                                     ("GET", f"/api/models/org/tiny/tree/{sha}")]
    assert fake_hub.log[1].query == "recursive=true&expand=false"
    for method in ("HEAD", "GET"):
        assert sorted(p for m, p in fake_hub.requests[2:] if m == method) == [
            f"/org/tiny/resolve/{sha}/{name}" for name in TINY_FILES]
    assert all(r.status == 200 and "authorization" not in r.headers for r in fake_hub.log)
    assert all("xet" not in p for _, p in fake_hub.requests)


def test_hf_hub_download_one_file_and_the_lfs_etag(fake_hub, hub_env, tiny_repo_dir):
    import hashlib

    sha = fake_hub.add_repo("org/tiny", tiny_repo_dir)
    config = hf.hf_hub_download("org/tiny", "config.json")
    weights = hf.hf_hub_download("org/tiny", "model.safetensors")
    assert pathlib.Path(config).read_bytes() == (tiny_repo_dir / "config.json").read_bytes()
    assert fake_hub.requests == [
        ("HEAD", "/org/tiny/resolve/main/config.json"),
        ("GET", "/org/tiny/resolve/main/config.json"),
        ("HEAD", "/org/tiny/resolve/main/model.safetensors"),
        ("GET", "/org/tiny/resolve/main/model.safetensors")]
    assert fake_hub.log[0].status == 200 and sha in config
    # An LFS file's blob is named by its sha256, as on the Hub.
    data = (tiny_repo_dir / "model.safetensors").read_bytes()
    assert os.path.basename(os.path.realpath(weights)) == hashlib.sha256(data).hexdigest()


def test_revision_as_branch_and_as_commit(fake_hub, hub_env, tiny_repo_dir, tiny_repo_factory):
    v2_dir = tiny_repo_factory(1)
    (v2_dir / "pytorch_model.bin").unlink()
    main = fake_hub.add_repo("org/tiny", tiny_repo_dir)
    v2 = fake_hub.add_repo("org/tiny", v2_dir, branch="v2")
    assert main != v2 and fake_hub.commit("org/tiny", "v2") == v2 and len(v2) == 40

    _assert_same_files(hf.snapshot_download("org/tiny", revision="v2"), v2_dir)
    assert (hub_env.cache / "models--org--tiny" / "refs" / "v2").read_text() == v2
    fake_hub.clear_log()
    # A commit needs no look-up: the client skips the repo info call.
    _assert_same_files(hf.snapshot_download("org/tiny", revision=main), tiny_repo_dir)
    assert ("GET", "/api/models/org/tiny/revision/" + main) not in fake_hub.requests
    assert fake_hub.requests[0] == ("GET", f"/api/models/org/tiny/tree/{main}")
    # Moving a branch: old commits stay reachable by sha.
    assert fake_hub.add_repo("org/tiny", v2_dir, branch="main") == v2
    assert hf.snapshot_download("org/tiny").endswith(v2)
    _assert_same_files(hf.snapshot_download("org/tiny", revision=main), tiny_repo_dir)


def test_allow_patterns_skip_the_bin(fake_hub, hub_env, tiny_repo_dir):
    fake_hub.add_repo("org/tiny", tiny_repo_dir)
    path = hf.snapshot_download("org/tiny", allow_patterns=["*.json", "*.safetensors"])
    assert sorted(_files(pathlib.Path(path))) == [n for n in TINY_FILES if n.endswith(
        (".json", ".safetensors"))]
    assert not [p for _, p in fake_hub.requests if p.endswith(".bin")]


def test_cache_dir_and_endpoint_arguments(fake_hub, hub_env, tiny_repo_dir, tmp_path):
    fake_hub.add_repo("org/tiny", tiny_repo_dir)
    path = hf.snapshot_download("org/tiny", cache_dir=tmp_path / "elsewhere",
                                endpoint=fake_hub.endpoint)
    assert path.startswith(str(tmp_path / "elsewhere" / "models--org--tiny" / "snapshots"))
    _assert_same_files(path, tiny_repo_dir)
    assert not hub_env.cache.exists()


def test_offline_and_unreachable_hub_return_the_cached_snapshot(
        fake_hub, hub_env, tiny_repo_dir):
    fake_hub.add_repo("org/tiny", tiny_repo_dir)
    path = hf.snapshot_download("org/tiny")
    fake_hub.stop()
    assert hf.snapshot_download("org/tiny") == path  # connection refused: the cache
    hub_env.offline()
    assert hf.snapshot_download("org/tiny") == path
    assert hf.hf_hub_download("org/tiny", "config.json") == os.path.join(path, "config.json")
    with pytest.raises(errors.LocalEntryNotFoundError, match="outgoing traffic has been"):
        hf.snapshot_download("org/other")


def test_gated_repo_needs_its_token(fake_hub, hub_env, tiny_repo_dir, monkeypatch):
    fake_hub.add_repo("org/gated", tiny_repo_dir, token="hf_secret")
    # Info and listing are public (as on the Hub); the files are not.
    assert hf.model_info("org/gated").gated == "manual"
    with pytest.raises(errors.GatedRepoError, match="Cannot access gated repo") as anonymous:
        hf.snapshot_download("org/gated")
    assert anonymous.value.response.status_code == 401
    assert "You must have access to it and be authenticated" in str(anonymous.value)
    with pytest.raises(errors.GatedRepoError, match="not in the authorized list") as wrong:
        hf.hf_hub_download("org/gated", "config.json", token="hf_wrong")
    assert wrong.value.response.status_code == 403
    _assert_same_files(hf.snapshot_download("org/gated", token="hf_secret"), tiny_repo_dir)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")  # read at each call, not at import
    assert hf.hf_hub_download("org/gated", "config.json", force_download=True)
    assert fake_hub.log[-1].headers["authorization"] == "Bearer hf_secret"


def test_private_and_missing_repos_revisions_and_files(fake_hub, hub_env, tiny_repo_dir):
    fake_hub.add_repo("org/tiny", tiny_repo_dir)
    fake_hub.add_repo("org/private", tiny_repo_dir, token="hf_secret", private=True)
    for repo, token, status in [("org/missing", None, 401), ("org/missing", "hf_x", 404),
                                ("org/private", None, 401), ("org/private", "hf_x", 404)]:
        with pytest.raises(errors.RepositoryNotFoundError,
                           match="Repository Not Found for url") as missing:
            hf.snapshot_download(repo, token=token)
        assert missing.type is errors.RepositoryNotFoundError
        assert missing.value.response.status_code == status
    assert hf.snapshot_download("org/private", token="hf_secret")
    with pytest.raises(errors.RevisionNotFoundError, match="Invalid rev id: nope"):
        hf.snapshot_download("org/tiny", revision="nope")
    with pytest.raises(errors.RevisionNotFoundError):
        hf.hf_hub_download("org/tiny", "config.json", revision="0" * 40)
    with pytest.raises(errors.RemoteEntryNotFoundError, match="Entry Not Found for url"):
        hf.hf_hub_download("org/tiny", "missing.txt")
    # The client remembers the miss under .no_exist/<commit>/.
    no_exist = hub_env.cache / "models--org--tiny" / ".no_exist"
    assert (no_exist / fake_hub.commit("org/tiny") / "missing.txt").exists()
    assert issubclass(errors.RemoteEntryNotFoundError, errors.EntryNotFoundError)


def test_tree_listing_pages(fake_hub, hub_env, tiny_repo_dir):
    sha = fake_hub.add_repo("org/tiny", tiny_repo_dir)
    fake_hub.tree_page_size = 2
    _assert_same_files(hf.snapshot_download("org/tiny"), tiny_repo_dir)
    pages = [r for r in fake_hub.log if r.path == f"/api/models/org/tiny/tree/{sha}"]
    assert len(pages) == 3  # 5 files and 1 directory, 2 a page
    assert [r.query.rpartition("cursor=")[2] for r in pages[1:]] == ["2", "4"]
    listing = hf.HfApi().list_repo_tree("org/tiny", path_in_repo="original")
    assert [(e.path, e.size) for e in listing] == [
        ("original/params.json", (tiny_repo_dir / "original/params.json").stat().st_size)]


def test_a_cut_download_is_retried_from_zero_in_the_same_call(
        fake_hub, hub_env, tiny_repo_dir):
    """The client buffers 10 MiB chunks: bytes of an unfinished chunk are dropped, so a
    small file cut midway is fetched again whole (no Range), within the same call."""
    sha = fake_hub.add_repo("org/tiny", tiny_repo_dir)
    fake_hub.cut_once("org/tiny", "model.safetensors", after_bytes=1000)
    _assert_same_files(hf.snapshot_download("org/tiny"), tiny_repo_dir)
    gets = [r for r in fake_hub.log
            if r.method == "GET" and r.path == f"/org/tiny/resolve/{sha}/model.safetensors"]
    assert [(r.status, r.headers.get("range")) for r in gets] == [(200, None), (200, None)]


def test_a_cut_after_a_full_chunk_resumes_with_a_range(fake_hub, hub_env, tmp_path):
    big = tmp_path / "big"
    big.mkdir()
    (big / "model.safetensors").write_bytes(os.urandom(CHUNK + 4096))
    fake_hub.add_repo("org/big", big)
    fake_hub.cut_once("org/big", "model.safetensors", after_bytes=CHUNK + 100)
    _assert_same_files(hf.snapshot_download("org/big"), big)
    gets = [r for r in fake_hub.log if r.method == "GET" and "/resolve/" in r.path]
    assert [(r.status, r.headers.get("range")) for r in gets] == [
        (200, None), (206, f"bytes={CHUNK}-")]
    assert not list((hub_env.cache / "models--org--big" / "blobs").glob("*.incomplete"))


def test_a_download_cut_on_every_try_fails_then_the_next_call_completes_it(
        fake_hub, hub_env, tiny_repo_dir):
    """One try and five retries (1 s apart), then the error; the partial file is deleted
    (it has a name unique to the call), so the next call fetches that file again, whole,
    and nothing else: the listing comes from the client's tree cache."""
    sha = fake_hub.add_repo("org/tiny", tiny_repo_dir)
    fake_hub.cut("org/tiny", "model.safetensors", after_bytes=0, times=6)
    with pytest.raises(httpx2.RemoteProtocolError,
                       match="peer closed connection without sending complete message body"):
        hf.snapshot_download("org/tiny")
    storage = hub_env.cache / "models--org--tiny"
    assert not list((storage / "blobs").glob("*.incomplete"))
    assert not (storage / "snapshots" / sha / "model.safetensors").exists()
    with pytest.raises(errors.IncompleteSnapshotError, match=r"1 file\(s\) are missing"):
        hf.snapshot_download("org/tiny", local_files_only=True)

    fake_hub.clear_log()
    _assert_same_files(hf.snapshot_download("org/tiny"), tiny_repo_dir)
    url = f"/org/tiny/resolve/{sha}/model.safetensors"
    assert fake_hub.requests == [("GET", "/api/models/org/tiny/revision/main"),
                                 ("HEAD", url), ("GET", url)]
    assert "range" not in fake_hub.log[-1].headers


def test_a_subprocess_finds_the_hub_through_the_environment(fake_hub, hub_env, tiny_repo_dir):
    sha = fake_hub.add_repo("org/tiny", tiny_repo_dir)
    code = "import huggingface_hub as h; print(h.snapshot_download('org/tiny'))"
    out = subprocess.run([sys.executable, "-c", code], env=hub_env.environ(),
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == str(hub_env.cache / "models--org--tiny" / "snapshots" / sha)
    assert all("authorization" not in r.headers for r in fake_hub.log)
    hub_env.offline()
    fake_hub.stop()
    out = subprocess.run([sys.executable, "-c", code], env=hub_env.environ(),
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().endswith(sha)
