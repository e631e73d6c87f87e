"""Models by Hugging Face Hub id: `resolve("org/name")` downloads (or finds in the Hub
cache) the files jaxinfer reads and returns their directory; an existing directory is
returned as it is. How a model reaches the disk, the flags and each error:
docs/models.md#models-by-hub-id.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re

from jaxinfer.config import EngineConfig

log = logging.getLogger(__name__)

# org/name, as the Hub spells repository ids (a path that exists is a directory first).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What jaxinfer reads: configs, tokenizers and templates (json, jinja), safetensors and
# their index, SentencePiece models. Only top-level files: never original/, onnx/, ...
ALLOW = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
CONFIG_ONLY = ["config.json", "generation_config.json"]
IGNORE = ["*/*", "consolidated.*"]
FALLBACK_WEIGHTS = (".bin", ".pth", ".pt", ".gguf", ".h5", ".msgpack")


def is_hub_id(model: str | os.PathLike) -> bool:
    """Whether `model` names a Hub repository rather than a directory: org/name, and no
    such directory here."""
    text = str(model)
    return bool(HUB_ID.fullmatch(text)) and not pathlib.Path(text).exists()


def resolve(model: str | os.PathLike, *, revision: str | None = None,
            download_dir: str | None = None, config_only: bool = False,
            what: str = "model") -> pathlib.Path:
    """The local directory of `model`: itself if it is a directory, else the Hub
    snapshot of id `model` at `revision` (a branch, tag or commit; default main) in
    `download_dir` (default: $HF_HUB_CACHE, under $HF_HOME). `config_only`: only its
    config.json (plan, aot). `what` names the argument in errors ("tokenizer", ...)."""
    if not is_hub_id(model):
        root = pathlib.Path(model)
        if not root.is_dir():
            raise FileNotFoundError(f"{what} directory {str(model)!r} does not exist (a "
                                    "Hub model is named org/name)")
        return root
    return _download(str(model), revision, download_dir, config_only, what)


def resolve_all(model: str | os.PathLike, config: EngineConfig
                ) -> tuple[pathlib.Path, EngineConfig]:
    """`model`, `config.tokenizer` and the speculative model as local directories, each
    downloaded from the Hub when it is an id (the settings' revisions and download_dir)."""
    root = resolve(model, revision=config.revision, download_dir=config.download_dir)
    changes: dict[str, object] = {}
    if config.tokenizer is not None:
        changes["tokenizer"] = str(resolve(config.tokenizer, revision=config.tokenizer_revision,
                                           download_dir=config.download_dir, what="tokenizer"))
    spec = config.speculative_config
    if spec is not None and spec.model is not None and is_hub_id(spec.model):
        local = resolve(spec.model, download_dir=config.download_dir,
                        what="speculative_config model")
        changes["speculative_config"] = dataclasses.replace(spec, model=str(local))
    return root, dataclasses.replace(config, **changes) if changes else config


def _download(repo: str, revision: str | None, download_dir: str | None,
              config_only: bool, what: str) -> pathlib.Path:
    import huggingface_hub

    options = _options(download_dir)
    shown = f"{repo}@{revision}" if revision else repo
    try:
        if not options["local_files_only"]:
            _check_repo(repo, revision, options, config_only, what)
        # the revision as given, not its commit: the cache then records the branch, so
        # an offline start finds it
        path = huggingface_hub.snapshot_download(
            repo, revision=revision, allow_patterns=CONFIG_ONLY if config_only else ALLOW,
            ignore_patterns=IGNORE, **options)
    except Exception as e:  # noqa: BLE001 (each Hub error becomes one line naming the fix)
        raise hub_error(e, shown, what, options) from None
    root = pathlib.Path(path)
    commit = root.name
    log.info("%s %s: %s (commit %s)", what, shown, root, commit)
    if not config_only:
        check_served(root, shown)
    return root


def _options(download_dir: str | None) -> dict:
    """snapshot_download's keywords from the environment, read now (the Hub library
    reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE once, when imported)."""
    from huggingface_hub import constants

    cache = download_dir or os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME")
        else constants.HF_HUB_CACHE)
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return {"cache_dir": cache, "local_files_only": offline or constants.HF_HUB_OFFLINE,
            "endpoint": os.environ.get("HF_ENDPOINT") or None,
            "token": os.environ.get("HF_TOKEN") or None}


def _check_repo(repo: str, revision: str | None, options: dict, config_only: bool,
                what: str) -> None:
    """Refuse, before any weight is fetched, a repository with no safetensors or of an
    architecture jaxinfer does not serve. The Hub out of reach: nothing to check here
    (snapshot_download then looks in the cache)."""
    import httpx2
    from huggingface_hub import HfApi, errors, hf_hub_download

    api = HfApi(endpoint=options["endpoint"], token=options["token"])
    try:
        info = api.model_info(repo, revision=revision)
    except (httpx2.TransportError, errors.OfflineModeIsEnabled):
        return
    names = [s.rfilename for s in info.siblings or ()]
    if "config.json" not in names:
        raise ValueError(f"{what} {repo!r} has no config.json at its top level; jaxinfer "
                         "serves transformers checkpoints")
    if not config_only and not any(n.endswith(".safetensors") for n in names):
        found = sorted({pathlib.PurePath(n).suffix for n in names
                        if n.endswith(FALLBACK_WEIGHTS)})
        raise ValueError(f"{what} {repo!r} has no .safetensors weights (only "
                         f"{', '.join(found) or 'no weights'}); jaxinfer reads safetensors "
                         "only. Convert it with transformers' save_pretrained")
    config = hf_hub_download(repo, "config.json", revision=info.sha, **options)
    check_architecture(json.loads(pathlib.Path(config).read_text()), repo)


def check_architecture(hf: dict, shown: str) -> None:
    """ValueError naming the architecture of `hf` unless jaxinfer serves it."""
    from jaxinfer.config import ARCHITECTURES

    archs = hf.get("architectures") or []
    text = hf.get("text_config") or {}
    served = [a for a in archs if a in ARCHITECTURES]
    if served or any(a in ARCHITECTURES for a in text.get("architectures") or []):
        return
    remote = " (it needs trust_remote_code, which jaxinfer refuses: it runs no code from " \
        "a checkpoint)" if "auto_map" in hf else ""
    raise ValueError(f"model {shown!r} is a {archs or hf.get('model_type')} model{remote}; "
                     f"jaxinfer serves {', '.join(sorted(ARCHITECTURES))}")


def check_served(root: pathlib.Path, shown: str) -> None:
    """Check a downloaded snapshot: a config.json jaxinfer serves, and safetensors."""
    config = root / "config.json"
    if config.is_file():
        check_architecture(json.loads(config.read_text()), shown)
    if not any(root.glob("*.safetensors")):
        raise ValueError(f"model {shown!r}: no .safetensors weights in {root}; jaxinfer "
                         "reads safetensors only")


def hub_error(error: Exception, shown: str, what: str, options: dict) -> Exception:
    """One line for a Hub failure, naming the id and the way out."""
    from huggingface_hub import errors

    cache = options["cache_dir"]
    if isinstance(error, ValueError | FileNotFoundError) and \
            not isinstance(error, errors.LocalEntryNotFoundError):
        return error
    if isinstance(error, errors.GatedRepoError):
        return PermissionError(
            f"{what} {shown!r} is gated or private and " + (
                "the token in HF_TOKEN was refused: accept its terms on the Hub with that "
                "account" if options["token"] else
                "no token was given: set HF_TOKEN to a token with access"))
    if isinstance(error, errors.RevisionNotFoundError):
        return FileNotFoundError(f"{what} {shown!r}: no such revision on the Hub "
                                 "(--revision takes a branch, tag or commit)")
    if isinstance(error, errors.RepositoryNotFoundError):
        private = "" if options["token"] else " (a private one needs HF_TOKEN)"
        return FileNotFoundError(f"{what} {shown!r} is neither a directory here nor a "
                                 f"repository on the Hub{private}")
    if isinstance(error, errors.IncompleteSnapshotError):
        return FileNotFoundError(
            f"{what} {shown!r}: the snapshot in {cache} is incomplete (an interrupted "
            "download) and the Hub cannot be reached; run again with network to finish it")
    if isinstance(error, errors.LocalEntryNotFoundError):
        how = ("HF_HUB_OFFLINE=1 is set (unset it to download)" if options["local_files_only"]
               else f"the Hub ({options['endpoint'] or 'huggingface.co'}) cannot be reached")
        return FileNotFoundError(
            f"{what} {shown!r} is not in the Hub cache {cache} and {how}; give "
            "--download_dir=DIR where it was downloaded, or a model directory")
    return OSError(f"{what} {shown!r}: the Hub download failed ({type(error).__name__}: "
                   f"{str(error).splitlines()[0] if str(error) else ''}); it resumes "
                   "where it stopped when run again")
