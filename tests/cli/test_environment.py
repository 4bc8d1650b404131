"""Every flag from an XDS_SERVER_* variable: a flag on the command line wins, a bad value
is a usage error naming the variable, and flags that exclude each other stay exclusive."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from xds_server.cli.environment import origin_of
from xds_server.cli.parser import build_parser

RUN = ["run", "--config", "c.yaml", "--plaintext"]


def parse(argv: list[str], **environ: str) -> argparse.Namespace:
    return build_parser(environ=environ).parse_args(argv)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], **environ: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse(argv, **environ)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_without_variables_the_defaults_hold() -> None:
    args = parse(RUN)
    assert (args.xds_port, args.admin_port, args.config_poll) == (18000, 9000, 1.0)
    assert (args.log_level, args.kubernetes, args.peer, args.debug_port) == (
        "info",
        False,
        None,
        None,
    )
    assert args.config == Path("c.yaml")


def test_a_variable_sets_a_flag_with_its_type() -> None:
    args = parse(
        RUN,
        XDS_SERVER_XDS_PORT="19000",
        XDS_SERVER_CONFIG_POLL="0.5",
        XDS_SERVER_LOG_LEVEL="debug",
        XDS_SERVER_KUBECONFIG="/k/config",
    )
    assert (args.xds_port, args.config_poll, args.log_level) == (19000, 0.5, "debug")
    assert args.kubeconfig == Path("/k/config")
    assert origin_of(args, "xds_port", "--xds-port") == "XDS_SERVER_XDS_PORT"
    assert origin_of(args, "admin_port", "--admin-port") == "--admin-port"


def test_a_flag_wins_over_its_variable_even_at_its_default_value() -> None:
    assert parse([*RUN, "--xds-port", "18500"], XDS_SERVER_XDS_PORT="19000").xds_port == 18500
    assert parse([*RUN, "--xds-port", "18000"], XDS_SERVER_XDS_PORT="19000").xds_port == 18000
    top = parse(["--log-level", "info", *RUN], XDS_SERVER_LOG_LEVEL="debug")
    assert top.log_level == "info"


def test_the_config_source_may_come_from_a_variable() -> None:
    args = parse(["run", "--plaintext"], XDS_SERVER_CONFIG="/etc/x/config.yaml")
    assert args.config == Path("/etc/x/config.yaml")
    assert args.configmap is None


def test_a_flag_sets_aside_the_variables_of_the_flags_it_excludes() -> None:
    args = parse(RUN, XDS_SERVER_CONFIGMAP="xds-server-config")
    assert (args.config, args.configmap) == (Path("c.yaml"), None)
    args = parse(
        ["run", "--config", "c.yaml", "--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "a"],
        XDS_SERVER_PLAINTEXT="true",
    )
    assert args.plaintext is False
    args = parse(["run", "--configmap", "cm", "--kubernetes"], XDS_SERVER_CONFIG="c.yaml")
    assert (args.config, args.configmap) == (None, "cm")


def test_two_variables_that_exclude_each_other_are_an_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(
        ["run", "--plaintext"], capsys, XDS_SERVER_CONFIG="c.yaml", XDS_SERVER_CONFIGMAP="cm"
    )
    assert "XDS_SERVER_CONFIG and XDS_SERVER_CONFIGMAP exclude each other" in err


def test_a_required_choice_names_its_flags_and_variables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(["run", "--plaintext"], capsys)
    assert "--config (XDS_SERVER_CONFIG) or --configmap (XDS_SERVER_CONFIGMAP)" in err


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("XDS_SERVER_XDS_PORT", "eighteen", "XDS_SERVER_XDS_PORT='eighteen': not a valid int"),
        ("XDS_SERVER_CONFIG_POLL", "1s", "XDS_SERVER_CONFIG_POLL='1s': not a valid float"),
        ("XDS_SERVER_LOG_LEVEL", "loud", "XDS_SERVER_LOG_LEVEL='loud': not one of debug"),
        ("XDS_SERVER_LOG_FORMAT", "xml", "XDS_SERVER_LOG_FORMAT='xml': not one of text, json"),
        ("XDS_SERVER_KUBERNETES", "maybe", "XDS_SERVER_KUBERNETES='maybe': give true or false"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable(
    variable: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in refused(RUN, capsys, **{variable: value})


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("1", True), ("YES", True), ("on", True), ("false", False), ("0", False)],
)
def test_switches(value: str, expected: bool) -> None:
    assert parse(RUN, XDS_SERVER_KUBERNETES=value).kubernetes is expected


def test_an_empty_variable_counts_as_unset() -> None:
    args = parse(RUN, XDS_SERVER_XDS_PORT="", XDS_SERVER_KUBERNETES=" ")
    assert (args.xds_port, args.kubernetes) == (18000, False)


def test_a_repeatable_flag_takes_a_list_and_the_command_line_replaces_it() -> None:
    environ = {"XDS_SERVER_PEER": "a:18000, b:18000,", "XDS_SERVER_WATCH_NAMESPACE": "x,y"}
    args = parse(RUN, **environ)
    assert args.peer == ["a:18000", "b:18000"]
    assert args.watch_namespace == ["x", "y"]
    args = parse([*RUN, "--peer", "c:18000", "--peer", "d:18000"], **environ)
    assert args.peer == ["c:18000", "d:18000"]


def test_bootstrap_reads_its_own_variables_not_the_servers() -> None:
    # XDS_SERVER_ADMIN_PORT is the server's admin port; the Envoy's is another.
    environ = {"XDS_SERVER_ADMIN_PORT": "9100", "XDS_SERVER_PLAINTEXT": "true"}
    args = parse(["bootstrap", "--tls-dir", "/tls"], **environ)
    assert (args.admin_port, args.plaintext) == (9901, False)
    args = parse(
        ["bootstrap"],
        XDS_SERVER_BOOTSTRAP_PLAINTEXT="true",
        XDS_SERVER_BOOTSTRAP_ADMIN_PORT="9902",
        XDS_SERVER_BOOTSTRAP_NODE_ID="envoy-7",
    )
    assert (args.plaintext, args.admin_port, args.node_id) == (True, 9902, "envoy-7")


def test_check_config_shares_the_servers_variables() -> None:
    args = parse(["check-config", "c.yaml"], XDS_SERVER_KUBERNETES="true")
    assert args.kubernetes is True


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_help_shows_every_flags_variable_and_default() -> None:
    parser = build_parser(environ={})
    for name, command in {"": parser, **_subcommands(parser)}.items():
        prefix = "XDS_SERVER_BOOTSTRAP_" if name == "bootstrap" else "XDS_SERVER_"
        text = " ".join(command.format_help().split())
        for action in command._actions:
            option = max(action.option_strings, key=len, default="")
            if not option or option in ("--help", "--version"):
                continue
            variable = prefix + option.lstrip("-").upper().replace("-", "_")
            assert f"env {variable}" in text, (name, option)
    run_help = " ".join(_subcommands(parser)["run"].format_help().split())
    for shown in ("default: 18000", "default: 9000", "default: 127.0.0.1", "default: 1.0"):
        assert shown in run_help
    boot_help = " ".join(_subcommands(parser)["bootstrap"].format_help().split())
    for shown in ("default: 9901", "default: envoy-0", "default: /etc/envoy/sds"):
        assert shown in boot_help
