"""hbp bench entry point: one benchmark run per config (Hydra).

    python run.py workload=gpt2 mode=checkpoint profile=small
    python run.py -m workload=gpt2,resnet,unet,synthetic_dag mode=naive,checkpoint logger=none
    python run.py experiment=matrix_tiny                   # a README table (conf/experiment/)
    python run.py -m sweep=budget [workload=gpt2]          # a named sweep (conf/sweep/), resumable
    torchrun --nproc_per_node=2 run.py distributed=ddp workload=gpt2 mode=tiny

Config: conf/config.yaml and its groups (workload/, mode/, profile/, logger/, sweep/,
experiment/, distributed/); see README.md.
Bad input gets one line on stderr, "error: <field>=<value> is not accepted: expected ...", and
exit code 2, before anything is written (hbp.bench.RunGuard, hbp.bench.hydra_main).
"""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent / "conf"
CHECKED_GROUPS = (
    "framework",
    "workload",
    "mode",
    "profile",
    "logger",
    "sweep",
    "experiment",
    "distributed",
)


def parsed_overrides(args: list[str]) -> list | None:
    """The `key=value` arguments as Hydra parses them; None where it cannot (Hydra then says
    why itself)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        return OverridesParser.create().parse_overrides(
            [a for a in args if "=" in a and not a.startswith("-")]
        )
    except Exception:
        return None


def check_group_choices(overrides: list) -> None:
    """Reject `group=option` overrides naming an option that conf/<group>/ does not have, with
    the accepted options (Hydra's own message buries them under its config search path)."""
    for override in overrides:
        group = override.key_or_group
        if group not in CHECKED_GROUPS or override.is_delete() or override.package is not None:
            continue
        accepted = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        try:
            sweep = override.is_sweep_override()
            values = list(override.sweep_string_iterator()) if sweep else [override.value()]
        except Exception:  # glob(), range() and the like: Hydra checks those itself
            continue
        for value in values:
            if isinstance(value, str) and value not in accepted:
                sys.stderr.write(
                    f"error: {group}={value!r} is not accepted: expected one of "
                    + ", ".join(accepted)
                    + "\n"
                )
                sys.exit(2)


def check_keys(overrides: list) -> None:
    """Reject `key=value` overrides of a key the composed config does not have (`stepz=3`,
    `mode.budgt=0.5`): one line naming the key and, where it has a section, that section's
    keys (Hydra's own message is six lines, exit code 1). The config is composed with the
    groups chosen (a sweep's first option), only where a key is to be checked; anything this
    cannot compose is left to Hydra."""
    groups, keys = [], []
    try:
        for o in overrides:
            if o.is_delete() or o.is_add() or o.is_force_add() or o.package is not None:
                continue
            if o.key_or_group in CHECKED_GROUPS:
                first = next(iter(o.sweep_string_iterator())) if o.is_sweep_override() else None
                groups.append(f"{o.key_or_group}={first if first is not None else o.value()}")
            elif not (
                o.key_or_group.startswith("hydra")  # hydra.run.dir, hydra/launcher
                or "/" in o.key_or_group
                or (CONF_DIR / o.key_or_group).is_dir()  # a group, not a key
            ):
                keys.append(o.key_or_group)
        if not keys:
            return
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", groups)
    except Exception:
        return
    for key in keys:
        if OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT:
            continue
        section, _, _ = key.rpartition(".")
        where = OmegaConf.select(cfg, section, default=None) if section else cfg
        known = ", ".join(sorted(str(k) for k in where)) if hasattr(where, "keys") else ""
        sys.stderr.write(
            f"error: {key} is not a key of this config"
            + (f": {section or 'the top level'} has {known}" if known else "")
            + " (+key=value adds one on purpose)\n"
        )
        sys.exit(2)


_ABSENT = object()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    from hbp.bench import hydra_main

    return hydra_main(cfg)


def quiet_nonzero_rank(args: list[str]) -> list[str]:
    """Under torchrun only rank 0 writes: other ranks get no run dir files and no log file."""
    if int(os.environ.get("RANK", "0")) == 0:
        return args
    return [*args, "hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled"]


if __name__ == "__main__":
    overrides = parsed_overrides(sys.argv[1:])
    if overrides is not None:
        check_group_choices(overrides)
        check_keys(overrides)
    sys.argv[1:] = quiet_nonzero_rank(sys.argv[1:])
    from hbp.bench.rundir import register_resolvers

    register_resolvers()  # ${run_key:} (the sweep subdir); hbp.bench registers it too
    main()
