"""``infermeter plan`` and the ``dashboard`` subcommand's arguments."""

from __future__ import annotations

from launcher.cli import build_parser, main


def test_plan_prints_the_table(capsys):
    """The planner CLI prints the memory split and one row per GPU, priced from the config."""
    assert (
        main(
            [
                "plan",
                "--params",
                "70",
                "--precision",
                "fp8",
                "--context",
                "8192",
                "--concurrency",
                "16",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "weights 70.0 GB + KV cache 42.9 GB + overhead 11.3 GB = 124.2 GB" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert rows["H200"][3] == "1"
    assert rows["H100"][-1] == "7.80"
    assert rows["H200"][-1] == "\u2014"  # the demo price book has no H200: missing, one notation
    assert "no price in prices.usd_per_gpu_hour for H200" in out
    assert rows["T4"][3:6] == ["does", "not", "fit"]


def test_plan_one_gpu(capsys):
    """--gpu limits the table to that GPU model."""
    assert main(["plan", "--params", "8", "--precision", "bf16", "--gpu", "L4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].split()[0] == "L4"
    assert lines[-1] == "\u2014 USD/hour: no price in prices.usd_per_gpu_hour for L4"
    assert len(lines) == 5


def test_plan_refuses_a_bad_size(capsys):
    """A non-positive size is a one-line error and exit code 2."""
    assert main(["plan", "--params", "0"]) == 2
    assert "params_billions must be positive" in capsys.readouterr().err


def test_dashboard_arguments():
    """infermeter dashboard takes --config, --listen and --billing-url."""
    args = build_parser().parse_args(
        ["dashboard", "--listen", "127.0.0.1:1", "--billing-url", "http://b"]
    )
    assert (args.listen, args.billing_url) == ("127.0.0.1:1", "http://b")
    assert callable(args.handler)


def test_plan_takes_a_size_without_preset_from_its_shape(capsys):
    """A size no preset has is planned from the layers and heads given on the command line."""
    argv = ["plan", "--params", "13", "--layers", "40", "--kv-heads", "40", "--head-dim", "128"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("13B bf16, 40 layers x 40 KV heads x 128")


def test_plan_refuses_a_size_it_has_no_shape_for(capsys):
    """A size no preset has, without its shape, is refused rather than planned as another model."""
    assert main(["plan", "--params", "13"]) == 2
    assert "no model shape for 13B parameters" in capsys.readouterr().err
