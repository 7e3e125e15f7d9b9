"""For bench/gpu_device_run.sh only: two torch 2.13 helpers of torch.distributed, given to an
older torch (the lent GPU machine has 2.11) so that stalwart's recoverable process group can
be tried there. Not part of stalwart: stalwart itself refuses a torch without them
(orchestrator/compat.py), and STALWART_ALLOW_UNTESTED_VERSIONS does not change that.

- ``distributed_c10d._register_pg_in_world``: missing before 2.13; the same body as 2.13's
  (the global registries' updates that 2.11 does inline in ``_new_process_group_helper``).
- ``distributed_c10d._new_group_with_tag``: 2.13 hands subgroup creation to a default group
  that implements ``new_group`` (stalwart's AbortableProcessGroup); older versions build a
  backend group of their own. Wrapped to do the same; otherwise the original runs.

Loaded by a .pth file in the device script's site folder (every Python process there: the
driver, Ray's workers, the gpu_check ranks) when STALWART_TORCH_BACKPORT=1; it patches
torch.distributed.distributed_c10d right after that module is first imported, so a process
that never imports torch pays nothing. A torch that has both helpers is left alone.
"""

from __future__ import annotations

import os
import sys

TARGET = "torch.distributed.distributed_c10d"
applied: list[str] = []


def _register_pg_in_world(
    pg,
    backend_name,
    store,
    group_name,
    backend_config,
    rank_mapping=None,
    pg_tag=None,
    user_tag=None,
    add_to_default_tag=False,
):
    """torch 2.13's distributed_c10d._register_pg_in_world (backported)."""
    c10d = sys.modules[TARGET]
    world = c10d._world
    world.pg_map[pg] = (backend_name, store)
    world.pg_names[pg] = group_name
    world.pg_backend_config[pg] = backend_config
    c10d._register_process_group(group_name, pg)
    if rank_mapping is not None:
        world.pg_group_ranks[pg] = rank_mapping
    if pg_tag is None:
        pg_tag = f"ptd:{group_name}"
    if user_tag is not None:
        world.tags_to_pg.setdefault("", []).append(pg)
        user_pg_tag = f"user:{user_tag}"
        world.tags_to_pg.setdefault(user_pg_tag, []).append(pg)
        world.pg_to_tag[pg] = user_pg_tag
    else:
        if add_to_default_tag:
            world.tags_to_pg.setdefault("", []).append(pg)
        world.tags_to_pg.setdefault(pg_tag, []).append(pg)
        world.pg_to_tag[pg] = pg_tag


def _delegating_new_group(original):
    def _new_group_with_tag(
        ranks=None,
        timeout=None,
        backend=None,
        backend_options=None,
        pg_tag=None,
        use_local_synchronization=False,
        group_desc=None,
        device_id=None,
        **newer,  # a newer caller's arguments (sort_ranks), passed on to the original
    ):
        """torch 2.13's delegation (backported): if the default group implements new_group,
        default_pg.new_group makes the subgroup; else the original helper."""
        c10d = sys.modules[TARGET]
        default_pg = c10d._get_default_group()
        if not callable(getattr(default_pg, "new_group", None)):
            return original(
                ranks,
                timeout,
                backend,
                backend_options,
                pg_tag,
                use_local_synchronization,
                group_desc,
                device_id,
                **newer,
            )
        default_backend, default_store = c10d._world.pg_map[default_pg]
        backend = c10d.Backend(backend or default_backend)
        if use_local_synchronization and ranks is not None and c10d.get_rank() not in ranks:
            return None
        if ranks is None:
            ranks = list(range(default_pg.size()))
        elif newer.get("sort_ranks", True):
            ranks = sorted(ranks)
        group_name = c10d._process_group_name(ranks, use_hashed_name=use_local_synchronization)
        pg = default_pg.new_group(
            ranks,
            timeout=timeout,
            pg_options=backend_options,
            group_name=group_name,
            group_desc=group_desc,
        )
        if pg is None:
            return c10d.GroupMember.NON_GROUP_MEMBER
        c10d._register_pg_in_world(
            pg,
            backend_name=backend,
            store=c10d.PrefixStore(f"{group_name}/", default_store),
            group_name=group_name,
            backend_config=str(c10d.BackendConfig(backend)),
            rank_mapping={g: i for i, g in enumerate(ranks)},
        )
        return pg

    return _new_group_with_tag


def patch(c10d) -> None:
    import inspect

    if not hasattr(c10d, "_register_pg_in_world"):
        c10d._register_pg_in_world = _register_pg_in_world
        applied.append("_register_pg_in_world")
    helper = c10d._new_group_with_tag
    if "default_pg.new_group" not in inspect.getsource(helper):
        c10d._new_group_with_tag = _delegating_new_group(helper)
        applied.append("_new_group_with_tag")
    if applied:
        print(
            f"torch_backport: torch.distributed.distributed_c10d.{', '.join(applied)} "
            "backported from torch 2.13 (bench/torch_backport.py)",
            file=sys.stderr,
        )


class _PatchOnImport:
    """A meta path finder that runs patch() once the real module has been executed."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once, and not asked again by the finders below
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module
        except Exception:  # never break an import: the module then loads unpatched
            return None

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if os.environ.get("STALWART_TORCH_BACKPORT") != "1":
        return
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    else:
        sys.meta_path.insert(0, _PatchOnImport())


install()
