"""The Hydra config: every group option composes and validates, struct mode rejects unknown
keys, run directories follow the documented layout (sweep jobs named by run key), and
`hbp.bench.validate` rejects bad values with the field and the accepted values."""

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from hbp import bench
from hbp.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
GROUPS = ("framework", "workload", "mode", "profile", "logger", "distributed")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def make_cfg(*overrides: str, return_hydra_config: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", list(overrides), return_hydra_config=return_hydra_config)


def test_groups_have_the_required_options():
    assert {"gpt2", "resnet", "unet", "synthetic_dag"} <= set(options("workload"))
    assert {"naive", "checkpoint"} <= set(options("mode"))
    assert options("profile") == ["large", "medium", "small", "tiny"]
    assert options("logger") == ["none", "table", "wandb"]


@pytest.mark.parametrize(
    "group, option", [(g, o) for g in GROUPS for o in options(g)], ids=lambda v: str(v)
)
def test_every_group_option_composes_and_validates(group, option, tmp_path):
    cfg = make_cfg(f"{group}={option}", f"output_root={tmp_path}")
    assert cfg[group].name == option
    bench.validate(cfg)


def test_defaults():
    cfg = make_cfg()
    assert (cfg.workload.name, cfg.mode.name, cfg.profile.name) == ("gpt2", "naive", "small")
    assert cfg.device == "auto" and cfg.steps >= 1 and cfg.warmup >= 0 and cfg.verify is False
    assert cfg.threads is None and cfg.output_root == "outputs"


@pytest.mark.parametrize("override", ["foo=1", "mode.segmnts=2", "workload.depth=3", "logger.x=1"])
def test_struct_mode_rejects_unknown_keys(override):
    with pytest.raises(ConfigCompositionException, match="Could not override") as info:
        make_cfg(override)
    assert "not in struct" in str(info.value.__cause__)


def test_unknown_group_option_is_rejected():
    with pytest.raises(Exception, match="Could not find 'workload/bert'"):
        make_cfg("workload=bert")


def test_run_and_sweep_directories():
    cfg = make_cfg(
        "workload=unet", "mode=checkpoint", "output_root=/data/out", return_hydra_config=True
    )
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)  # for ${hydra:...} interpolations
    run_dir = Path(cfg.hydra.run.dir)
    assert run_dir.parent.parent == Path("/data/out/runs")
    assert run_dir.name.endswith("_unet_checkpoint")
    assert Path(cfg.hydra.sweep.dir).parent.parent == Path("/data/out/multirun")
    subdir = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)["subdir"]
    assert subdir == "${workload.name}_${mode.name}_${run_key:}"
    assert cfg.hydra.job.chdir is False
    assert cfg.hydra.callbacks.guard._target_ == "hbp.bench.RunGuard"


def test_chunked_loss_reaches_workloads_that_have_the_field():
    cfg = make_cfg("workload=gpt2", "mode=checkpoint", "mode.chunked_loss=true")
    assert bench.workload_overrides(cfg) == {"chunked_loss": True}
    assert bench.workload_overrides(cfg, with_mode_options=False) == {}
    cfg = make_cfg(
        "workload=gpt2",
        "mode=checkpoint",
        "mode.chunked_loss=true",
        "workload.chunked_loss=false",
        "workload.n_layer=2",
    )
    assert bench.workload_overrides(cfg) == {"chunked_loss": False, "n_layer": 2}
    cfg = make_cfg("workload=resnet", "mode=checkpoint", "mode.chunked_loss=true")
    assert bench.workload_overrides(cfg) == {}


@pytest.mark.parametrize(
    "override, field, accepted",
    [
        ("steps=0", "steps", "integer >= 1"),
        ("steps=1.5", "steps", "integer >= 1"),
        ("warmup=-1", "warmup", "integer >= 0"),
        ("seed=abc", "seed", "an integer"),
        ("verify=maybe", "verify", "true or false"),
        ("threads=0", "threads", "integer >= 1"),
        ("device=tpu", "device", "auto, cpu, cuda"),
        ("workload.n_layer=0", "workload.n_layer", "integer >= 1"),
        ("mode=checkpoint mode.segments=-2", "mode.segments", "integer >= 1"),
        ("profile.name=huge", "profile.name", "small, medium, large"),
        # checked before the run, whatever WANDB_MODE says (the tests set it)
        ("logger=wandb logger.wandb.mode=foo", "logger.wandb.mode", "offline, online, disabled"),
    ],
)
def test_validate_names_the_field_and_the_accepted_values(override, field, accepted, tmp_path):
    cfg = make_cfg(*override.split(), f"output_root={tmp_path}")
    with pytest.raises(ConfigError) as info:
        bench.validate(cfg)
    assert info.value.field == field
    assert accepted in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_is_rejected():
    with pytest.raises(ConfigError, match="no CUDA device"):
        bench.validate(make_cfg("device=cuda"))


def test_unwritable_output_root_is_rejected_without_creating_anything(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError) as info:
        bench.validate(make_cfg(f"output_root={blocker}/out"))
    assert info.value.field == "output_root" and "not a directory" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    bench.check_writable(tmp_path / "new" / "deeper")  # creatable: fine, and not created
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe is gone too
    if Path("/proc").is_dir():  # permissions allow it (as root), the filesystem does not
        with pytest.raises(ConfigError, match="/proc") as info:
            bench.check_writable("/proc/out")  # (a user other than root: "not writable")
        assert "cannot make a directory" in str(info.value) or "not writable" in str(info.value)


def test_threads(monkeypatch):
    assert bench.resolve_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert bench.resolve_threads(None) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    cpus = len(os.sched_getaffinity(0))
    assert bench.resolve_threads(None) == min(cpus, bench.MAX_AUTO_THREADS)
    assert bench.resolve_threads(None, jobs=64) == 1
