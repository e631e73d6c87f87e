"""A warm start without tracing: each jitted program is exported once (`jax.export`,
over its flattened arguments) into `<compilation cache>/exported/`, keyed by
jaxinfer's source, JAX's version and settings, the devices, the program's settings
and its arguments' shapes and shardings. A later start deserializes the module
instead of tracing and lowering the model again, and the persistent compilation
cache supplies the executable. See docs/architecture.md#warm-starts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import os
import pathlib
import pickle
import tempfile
from collections.abc import Sequence

import jax
from jax import export

import jaxinfer

log = logging.getLogger(__name__)
FORMAT = 1  # bump when what a file holds changes
MAX_FILES = 512  # exported programs kept; the oldest go first


@dataclasses.dataclass
class ExportCounts:
    """Programs this process read from the export cache, and wrote to it."""

    read: int = 0
    written: int = 0


COUNTS = ExportCounts()


@dataclasses.dataclass(frozen=True)
class FlatProgram:
    """A compiled program over flattened arguments, called with the original pytrees."""

    compiled: jax.stages.Compiled
    out_tree: jax.tree_util.PyTreeDef

    def __call__(self, *args: object) -> object:
        return jax.tree.unflatten(self.out_tree, self.compiled(*jax.tree.leaves(args)))

    def __getattr__(self, name: str) -> object:
        """The rest of `jax.stages.Compiled` (as_text, cost_analysis, ...) as compiled."""
        if name.startswith("__") or name == "compiled":  # copy and pickle probe these
            raise AttributeError(name)
        return getattr(self.compiled, name)


@dataclasses.dataclass(frozen=True)
class FlatLowering:
    """A lowered FlatProgram: `compile()` it (outside the lowering lock)."""

    lowered: jax.stages.Lowered
    out_tree: jax.tree_util.PyTreeDef

    def compile(self) -> FlatProgram:
        return FlatProgram(self.lowered.compile(), self.out_tree)


def lower(jitted: jax.stages.Wrapped, args: Sequence[object], *, name: str,
          settings: object, donate_argnums: Sequence[int] = ()
          ) -> FlatLowering | jax.stages.Lowered:
    """`jitted` lowered for `args` (arrays, or ShapeDtypeStructs with their shardings),
    through the export cache when the persistent compilation cache is on; else as
    JAX lowers it. `settings`: what `jitted` was built from (its repr is in the key)."""
    directory = export_directory()
    leaves, in_tree = jax.tree.flatten(tuple(args))
    specs = [_spec(x) for x in leaves]
    donate = _flat_indices(args, donate_argnums)
    key = _key(name, settings, in_tree, specs, donate) if directory else None
    if key is None:
        return jitted.lower(*args)
    path = directory / f"{name}-{key}.jax"
    found = _read(path)
    if found is None:
        try:
            found = _export(jitted, in_tree, specs, donate)
        except (ValueError, NotImplementedError) as e:  # e.g. a kernel's custom call
            log.info("%s: not exported (%s); traced on every start", name, e)
            return jitted.lower(*args)
        _write(path, found)
    exported, out_tree = found
    wrapper = jax.jit(exported.call, in_shardings=tuple(s.sharding for s in specs),
                      donate_argnums=donate)
    return FlatLowering(wrapper.lower(*specs), out_tree)


def export_directory() -> pathlib.Path | None:
    """Where exported programs live: beside the compilation cache's entries (whose
    names end in "-cache", so JAX's own cache never reads them); None when off."""
    cache = jax.config.jax_compilation_cache_dir
    return pathlib.Path(cache).expanduser() / "exported" if cache else None


def _spec(x: object) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        raise ValueError("every argument needs its sharding (an array, or a "
                         "ShapeDtypeStruct made with sharding=...)")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding,
                                weak_type=getattr(x, "weak_type", False))


def _flat_indices(args: Sequence[object], argnums: Sequence[int]) -> tuple[int, ...]:
    """The flat positions of the leaves of `args[i]` for each i in `argnums`."""
    out, start = [], 0
    for i, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        if i in argnums:
            out.extend(range(start, start + count))
        start += count
    return tuple(out)


def _key(name: str, settings: object, in_tree: object, specs: list, donate: tuple
         ) -> str | None:
    """The program's digest, or None where some part has no stable text (an object's
    default repr carries its address, which would change on every start)."""
    text = repr((FORMAT, name, settings, str(in_tree), donate,
                 [(s.shape, str(s.dtype), s.weak_type, repr(s.sharding)) for s in specs],
                 _environment()))
    if " at 0x" in text:
        log.info("%s: settings without a stable repr; traced on every start", name)
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.cache
def _environment() -> tuple:
    """What the whole process contributes to a key: jaxinfer's own source (a change to
    any module may change what a program traces to), JAX's versions, devices and
    settings."""
    root = pathlib.Path(jaxinfer.__file__).parent
    source = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        source.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    devices = jax.devices()
    return (source.hexdigest(), jax.__version__, importlib.metadata.version("jaxlib"),
            devices[0].client.platform_version, [str(d) for d in devices],
            sorted((k, repr(v)) for k, v in jax.config.values.items()
                   if k != "jax_compilation_cache_dir"))


def _export(jitted: jax.stages.Wrapped, in_tree: object, specs: list, donate: tuple
            ) -> tuple[export.Exported, object]:
    """`jitted` traced over flat arguments and exported, with its outputs' tree."""
    box = {}

    def flat(*leaves: object) -> list:
        out, box["tree"] = jax.tree.flatten(jitted(*jax.tree.unflatten(in_tree, leaves)))
        return out

    outer = jax.jit(flat, in_shardings=tuple(s.sharding for s in specs),
                    donate_argnums=donate)
    return export.export(outer)(*specs), box["tree"]


def _read(path: pathlib.Path) -> tuple[export.Exported, object] | None:
    try:
        data, out_tree = pickle.loads(path.read_bytes())
        exported = export.deserialize(bytearray(data))
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged or foreign file is exported again, not fatal
        log.warning("%s unreadable (%s); exporting again", path, e)
        return None
    COUNTS.read += 1
    return exported, out_tree


def _write(path: pathlib.Path, found: tuple[export.Exported, object]) -> None:
    """Write atomically (another process may be reading or writing the same key); a
    failure to write only costs the next start a trace."""
    exported, out_tree = found
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = pickle.dumps((bytes(exported.serialize()), out_tree))
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            f.write(data)
        os.replace(f.name, path)
        COUNTS.written += 1
        _prune(path.parent)
    except OSError as e:
        log.warning("could not write %s: %s", path, e)


def _prune(directory: pathlib.Path) -> None:
    files = sorted(directory.glob("*.jax"), key=lambda p: p.stat().st_mtime)
    for path in files[:-MAX_FILES]:
        path.unlink(missing_ok=True)
