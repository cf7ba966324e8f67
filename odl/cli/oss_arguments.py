"""The OSS flags every command accepts: ``--oss_ak``, ``--oss_sk``, ``--oss_endpoint``.

EasyRec's names (``odl-export`` had them first). They override ``OSS_ACCESS_KEY_ID``,
``OSS_ACCESS_KEY_SECRET`` and ``OSS_ENDPOINT`` (``odl.storage.oss_credentials``); the secret is
hidden from ``ps`` at start (``odl.cli.command_line_secrets``), but the environment is the
better place for it.
"""

from __future__ import annotations

import argparse

from odl.cli.command_line_secrets import hide_secret_arguments
from odl.storage.oss_credentials import configure_oss, reset_oss_configuration
from odl.storage.oss_store import reset_oss_store


def add_oss_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the three OSS flags to a command's parser."""
    parser.add_argument("--oss_ak", default="",
                        help="OSS AccessKey id for oss:// paths (default: $OSS_ACCESS_KEY_ID)")
    parser.add_argument("--oss_sk", default="",
                        help="OSS AccessKey secret, never logged (default: "
                             "$OSS_ACCESS_KEY_SECRET, the better place for it)")
    parser.add_argument("--oss_endpoint", default="",
                        help="OSS endpoint, e.g. https://oss-cn-hangzhou.aliyuncs.com "
                             "(default: $OSS_ENDPOINT)")


def apply_oss_arguments(args: argparse.Namespace) -> None:
    """Hides ``--oss_sk`` from ``ps`` and makes the flags the process's OSS settings."""
    reset_oss_configuration()  # one command's flags never leak into the next in-process run
    reset_oss_store()
    if args.oss_sk:
        hide_secret_arguments([args.oss_sk])
    configure_oss(args.oss_ak, args.oss_sk, args.oss_endpoint)
