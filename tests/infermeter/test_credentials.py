"""``infermeter credential``: a pod's writer credential, derived where the pod starts."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from infermeter.config import Config
from infermeter.credentials import CredentialError, principal_for
from infermeter.identity import identity_from_environment, instance_credential
from infermeter.writers import Role, Writer, WriterKeys, credential_from, issue

SECRET = "writer-secret-of-the-test"
POD = {
    "POD_NAME": "vllm-small-0-7d9f8-abcde",
    "POD_IP": "10.1.2.3",
    "POD_UID": "u-1",
    "NODE_NAME": "node-b",
}


def test_an_instance_is_its_pod_at_its_address(config: Config) -> None:
    """Group from --replica, instance from POD_NAME, address from POD_IP and the sidecar's port."""
    writer = principal_for(config, "instance", POD, replica="small-0", port=9000)
    assert writer == Writer.for_instance("small-0", "vllm-small-0-7d9f8-abcde", "10.1.2.3:9000")
    v6 = principal_for(
        config, "instance", {**POD, "POD_IP": "fd00::7"}, replica="small-0", port=9000
    )
    assert v6.address == "[fd00::7]:9000"


def test_a_collector_is_its_node_and_an_autoscaler_its_name(config: Config) -> None:
    """The collector's principal names the node it runs on, from spec.nodeName."""
    assert principal_for(config, "collector", POD) == Writer.for_collector(["node-b"])
    assert principal_for(config, "autoscaler", {}, name="main") == Writer.for_autoscaler("main")


@pytest.mark.parametrize(
    ("env", "replica", "message"),
    [
        ({**POD, "POD_IP": ""}, "small-0", "POD_NAME and POD_IP"),
        ({k: v for k, v in POD.items() if k != "POD_NAME"}, "small-0", "POD_NAME and POD_IP"),
        (POD, "no-such-group", "no replica group 'no-such-group'"),
        ({**POD, "INFERMETER_INSTANCE": "other"}, "small-0", "differ"),
    ],
)
def test_a_pod_that_cannot_say_who_it_is_gets_no_credential(config, env, replica, message):
    """Without the downward API's values, or naming a group the configuration lacks: an error."""
    with pytest.raises(CredentialError, match=message):
        principal_for(config, "instance", env, replica=replica, port=9000)
    with pytest.raises(CredentialError, match="NODE_NAME"):
        principal_for(config, "collector", {})


def test_the_command_writes_a_credential_billing_takes_and_the_sidecar_reads(
    tmp_path: Path, config: Config
) -> None:
    """The file is owner-read-only; billing authenticates it; the sidecar's identity check accepts it."""
    out = tmp_path / "run" / "credential"
    env = {**os.environ, **POD, "INFERMETER_WRITER_SECRET": SECRET}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "credential",
            "--role",
            "instance",
            "--replica",
            "small-0",
            "--port",
            "9000",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o400
    token = out.read_text().strip()
    writer = WriterKeys(SECRET.encode()).authenticate(token)
    assert writer.principal == "instance:small-0/vllm-small-0-7d9f8-abcde@10.1.2.3:9000"
    identity = identity_from_environment(config.replica("small-0"), POD)
    assert instance_credential(identity, {"C_FILE": str(out)}, "C") is not None
    # Run again (a restarted init container): the file is replaced, not refused.
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "credential",
            "--role",
            "collector",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    assert credential_from({"C_FILE": str(out)}, "C", Role.COLLECTOR) == issue(
        SECRET.encode(), Writer.for_collector(["node-b"])
    )


def test_without_the_secret_the_command_says_where_it_looked(tmp_path: Path) -> None:
    """One line naming the variable; exit code 2; no file."""
    env = {k: v for k, v in os.environ.items() if k != "INFERMETER_WRITER_SECRET"}
    out = tmp_path / "credential"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "credential",
            "--role",
            "autoscaler",
            "--out",
            str(out),
        ],
        env={**env, **POD},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "INFERMETER_WRITER_SECRET" in done.stderr
    assert not out.exists()
