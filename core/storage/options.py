"""Step 4's settings: THE merge of fsspec storage options, and their canonical key.

Every place that combines two sets of storage options uses ``merge_options``: the engine and the
``Store`` (``storage.storage_options`` of the config under a call's ``storage_options``), the CLI
(config under ``--storage-option``/``--endpoint-url``) and the Lightning adapters (the plugin's
or strategy's options under a call's). One semantics for all of them, documented in
docs/storage.md: the override wins key by key, and where both sides hold a mapping under the same
key (``client_kwargs``, ``config_kwargs``, ``s3_additional_kwargs``) those are merged the same way,
recursively. So a call that gives ``{"client_kwargs": {"region_name": "eu-west-1"}}`` keeps the
config's ``client_kwargs.endpoint_url``; a call that gives ``{"key": ...}`` replaces only the key.

``open_options`` adds the one default checkrun puts under them: botocore's own retries off on S3
(its backoff draws from Python's global ``random``, the stream a training script seeds and
checkpoints; checkrun's retries and s3fs's draw nothing from it).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Optional


def merge_options(base: Optional[Mapping], override: Optional[Mapping]) -> dict:
    """``override`` merged over ``base`` key by key, nested mappings recursively; a new dict.

    Neither argument is modified and the result shares no nested dict with them, so a caller may
    change it freely. ``None`` counts as empty."""
    out = {k: _copy(v) for k, v in (base or {}).items()}
    for key, value in (override or {}).items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge_options(out[key], value)
        else:
            out[key] = _copy(value)
    return out


_S3_SCHEMES = ("s3://", "s3a://")
NO_BOTOCORE_RETRIES = {"config_kwargs": {"retries": {"total_max_attempts": 1}}}
"""What ``open_options`` adds for S3 when the options give no ``config_kwargs.retries``."""


def open_options(url: str, options: Optional[Mapping]) -> dict:
    """The fsspec options checkrun opens ``url`` with: ``options``, and for an ``s3://`` URL whose
    options set no ``config_kwargs.retries``, botocore's own retries off (``NO_BOTOCORE_RETRIES``).

    botocore jitters each retry with ``random.random()``, Python's global generator: a throttled
    upload in the background would shift the random stream of the training thread, which
    accelerate checkpoints, so a resumed run would no longer repeat the run it resumes. Without
    them, transient errors are retried by checkrun (``storage.retry``, its own generator) and by
    s3fs (timeouts, dropped connections, SlowDown; no jitter). Options that set
    ``config_kwargs.retries``, given or in fsspec's configuration, are kept as they are; the
    ``config_kwargs`` of fsspec's configuration are kept under the default."""
    out = merge_options(options, None)
    if not os.fspath(url).startswith(_S3_SCHEMES) or not isinstance(out.get("config_kwargs") or {}, Mapping):
        return out  # not S3, or config_kwargs s3fs itself will reject
    # fsspec puts its configuration (config files, FSSPEC_S3_* variables) under the options with a
    # shallow update: a config_kwargs given here would hide a configured one, so it carries it along
    import fsspec.config

    configured: dict = {}
    for protocol in ("s3", "s3a"):  # s3fs's protocols, in the order fsspec applies them
        configured.update((fsspec.config.conf.get(protocol) or {}).get("config_kwargs") or {})
    given = merge_options(configured, out.get("config_kwargs"))
    if "retries" not in given:
        out["config_kwargs"] = merge_options(given, NO_BOTOCORE_RETRIES["config_kwargs"])
    return out


def _copy(value: Any) -> Any:
    return merge_options(value, None) if isinstance(value, Mapping) else value


def options_key(options: Optional[Mapping]) -> str:
    """A canonical, hashable text for a set of storage options (JSON with sorted keys).

    Equal options give equal keys whatever their order, nested mappings included; values JSON
    cannot write (a credentials object, a session) count by their ``repr``. Used to key caches of
    stores and filesystems, so options that differ (rotated credentials, another endpoint) never
    reach a store built for the others."""
    return json.dumps(options or {}, sort_keys=True, separators=(",", ":"), default=repr)
