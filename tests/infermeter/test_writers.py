"""Writer credentials as a process receives them, and seals as a spool writes them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from infermeter.config import Config
from infermeter.identity import IdentityError, identity_from_environment, instance_credential
from infermeter.serving import free_port
from infermeter.spool import Spool, read_segment
from infermeter.writers import (
    Credential,
    Role,
    Sealer,
    Writer,
    WriterError,
    WriterKeys,
    credential_from,
    issue,
    open_line,
    strip_seal,
)

SECRET = b"secret"
POD = {"INFERMETER_INSTANCE": "vllm-small-0-3"}


def test_an_instance_takes_only_its_own_credential(config: Config) -> None:
    """The sidecar's variable must hold the credential of its own instance of its own group."""
    identity = identity_from_environment(config.replica("small-0"), POD)
    own = issue(SECRET, Writer.for_instance("small-0", "vllm-small-0-3", "10.0.0.7:9000"))
    assert instance_credential(identity, {"V": own.token}, "V") == own
    assert instance_credential(identity, {}, "V") is None
    for other in (
        Writer.for_instance("small-0", "vllm-small-0-4"),
        Writer.for_instance("small-1", "vllm-small-0-3"),
        Writer.for_collector(["node-b"]),
    ):
        with pytest.raises(IdentityError, match="environment variable V: the credential of"):
            instance_credential(identity, {"V": issue(SECRET, other).token}, "V")
    with pytest.raises(IdentityError, match="environment variable V: a writer credential"):
        instance_credential(identity, {"V": "im-demo-ingest"}, "V")


def test_a_collector_or_autoscaler_takes_only_a_credential_of_its_role():
    """``credential_from`` refuses another role's credential, naming the variable."""
    collector = issue(SECRET, Writer.for_collector(["node-a"]))
    assert credential_from({"V": collector.token}, "V", Role.COLLECTOR) == collector
    with pytest.raises(
        WriterError, match="V: the credential of collector:node-a, not of a autoscaler"
    ):
        credential_from({"V": collector.token}, "V", Role.AUTOSCALER)


def test_billing_authenticates_what_its_secret_issued_and_nothing_else():
    """The key must be the one derived from billing's secret for the principal the token names."""
    keys = WriterKeys(SECRET)
    writer = Writer.for_instance("small-0", "small-0", "127.0.0.1:18102")
    assert keys.authenticate(issue(SECRET, writer).token) == writer
    forged = Credential(Writer.for_instance("small-0", "small-1"), issue(SECRET, writer).key)
    for token in (issue(b"other", writer).token, forged.token):
        with pytest.raises(WriterError):
            keys.authenticate(token)


async def test_a_sealing_spool_writes_each_line_sealed_and_reads_it_back_bare(tmp_path):
    """Every line carries its writer's seal; ``read_segment`` gives the records as appended."""
    sealer = Sealer(issue(SECRET, Writer.for_autoscaler()))
    spool = Spool(tmp_path, sealer=sealer)
    spool.open()
    records = [{"decision_id": f"d-{i}", "model": "chat-small"} for i in range(3)]
    for r in records:
        await spool.append(r)
    await spool.close()
    (segment,) = tmp_path.glob("seg-*.jsonl")
    lines = segment.read_bytes().splitlines(keepends=True)
    assert [sealer.vouches(line.rstrip(b"\n")) for line in lines] == [
        orjson.dumps(r) for r in records
    ]
    assert [strip_seal(line) for line in lines] == [orjson.dumps(r) + b"\n" for r in records]
    assert read_segment(segment) == (records, 0)
    assert WriterKeys(SECRET).check(lines[0])[0] == Writer.for_autoscaler()


def test_a_line_without_a_seal_opens_as_unsealed():
    """Plain JSON, a torn line and a seal with no MAC are not sealed lines."""
    for line in (b'{"a":1}\n', b'{"a":1,"seal":"x', b'{"a":1,"seal":"instance"}'):
        assert open_line(line) is None
        assert WriterKeys(SECRET).check(line) == (None, "unsealed")


def test_a_sidecar_with_another_instances_credential_does_not_start(tmp_path):
    """One line naming the variable and whose credential it holds; exit code 2; nothing served."""
    other = issue(SECRET, Writer.for_instance("small-0", "vllm-small-0-9"))
    env = {
        **os.environ,
        **POD,
        "INFERMETER_WRITER_CREDENTIAL": other.token,
        "INFERMETER__SIDECAR__SPOOL_DIR": str(tmp_path),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "sidecar",
            "--replica",
            "small-0",
            "--listen",
            f"127.0.0.1:{free_port()}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    errors = [
        line
        for line in done.stderr.splitlines()
        if line.startswith("infermeter:") and "WARNING" not in line
    ]
    assert len(errors) == 1, done.stderr
    assert "INFERMETER_WRITER_CREDENTIAL" in errors[0]
    assert "instance:small-0/vllm-small-0-9" in errors[0]
    assert "Traceback" not in done.stderr


def test_a_credential_handed_over_as_a_file_is_read_from_variable_file(
    tmp_path: Path, config: Config
) -> None:
    """``<variable>_FILE`` names the file an init container wrote; the variable itself wins."""
    identity = identity_from_environment(config.replica("small-0"), POD)
    own = issue(SECRET, Writer.for_instance("small-0", "vllm-small-0-3", "10.0.0.7:9000"))
    path = tmp_path / "credential"
    path.write_text(own.token + "\n")
    assert instance_credential(identity, {"V_FILE": str(path)}, "V") == own
    collector = issue(SECRET, Writer.for_collector(["node-a"]))
    path.write_text(collector.token)
    assert credential_from({"V_FILE": str(path)}, "V", Role.COLLECTOR) == collector
    assert (
        credential_from({"V": collector.token, "V_FILE": "/nonexistent"}, "V", Role.COLLECTOR)
        == collector
    )


def test_a_credential_file_that_cannot_be_read_is_one_error_naming_it(
    tmp_path: Path, config: Config
) -> None:
    """A missing file or one holding something else: an error naming the variable and the path."""
    identity = identity_from_environment(config.replica("small-0"), POD)
    missing = str(tmp_path / "absent")
    with pytest.raises(IdentityError, match=f"V_FILE={missing}: cannot read it"):
        instance_credential(identity, {"V_FILE": missing}, "V")
    with pytest.raises(WriterError, match=f"V_FILE={missing}: cannot read it"):
        credential_from({"V_FILE": missing}, "V", Role.AUTOSCALER)
    junk = tmp_path / "junk"
    junk.write_text("im-demo-ingest")
    with pytest.raises(IdentityError, match=f"V_FILE={junk}: a writer credential begins"):
        instance_credential(identity, {"V_FILE": str(junk)}, "V")
