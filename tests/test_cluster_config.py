"""ray_cluster.yaml passes Ray's own cluster-config checks: the steps `ray up` runs before it talks to the cloud.

``prepare_config`` merges the provider's defaults (ray/autoscaler/aws/defaults.yaml) and the setup commands;
``validate_config`` checks the result against ray/autoscaler/ray-schema.json plus Ray's cross-field rules.
Neither needs cloud credentials (the provider's bootstrap, which does, comes after them in `ray up`).
"""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIG = Path(__file__).resolve().parents[1] / "ray_cluster.yaml"


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CONFIG.read_text())


@pytest.fixture(scope="module")
def prepared(raw) -> dict:
    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    return config


def test_ray_accepts_the_config(prepared):
    assert prepared["cluster_name"] == "tune-prompts"
    assert prepared["provider"]["type"] == "aws"


def test_ray_validation_is_not_vacuous(raw):
    """The same validation refuses a misspelt key and a head type that is not defined."""
    typo = copy.deepcopy(raw)
    typo["available_node_types"]["cpu-scorer"]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(typo))
    no_head = copy.deepcopy(raw)
    no_head["head_node_type"] = "missing"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(prepare_config(no_head))


def test_node_types_head_cpu_scorers_and_gpu_openrlhf(prepared):
    types = prepared["available_node_types"]
    assert prepared["head_node_type"] == "head" and set(types) == {"head", "cpu-scorer", "gpu-openrlhf"}
    assert types["head"]["resources"].get("CPU") == 0  # no scoring work on the head
    assert types["cpu-scorer"]["resources"]["CPU"] > 0 and "GPU" not in types["cpu-scorer"]["resources"]
    assert types["gpu-openrlhf"]["resources"]["GPU"] >= 1


def test_every_node_runs_the_projects_setup_and_ray_from_its_venv(prepared):
    # After prepare_config, head/worker setup lists include the common setup_commands; the GPU type has its own.
    lists = {
        "head": prepared["head_setup_commands"],
        "worker": prepared["worker_setup_commands"],
        "gpu-openrlhf": prepared["available_node_types"]["gpu-openrlhf"]["worker_setup_commands"],
    }
    for where, commands in lists.items():
        assert any("bash scripts/setup.sh" in c for c in commands), f"{where} nodes never run scripts/setup.sh"
    assert any("boto3" in c for c in prepared["head_setup_commands"])  # the autoscaler launches nodes with it
    assert not any("pip install -U" in c and "ray" in c for c in sum(lists.values(), []))  # no Ray besides the lock's
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in prepared[key] if "ray start" in c]
        assert starts and all(".venv/bin/ray start" in c for c in starts), key
    assert any("--head" in c and "--dashboard-host=0.0.0.0" in c for c in prepared["head_start_ray_commands"])
    assert any("$RAY_HEAD_IP:6379" in c for c in prepared["worker_start_ray_commands"])


def test_the_repository_is_copied_without_the_venv(raw):
    assert list(raw["file_mounts"].values()) == ["."]
    assert ".venv" in raw["rsync_exclude"]
