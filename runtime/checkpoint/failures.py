"""Storage failures in one line: the cause a user can act on, found under DCP's wrapping.

A full disk surfaces from DCP as a per-rank traceback ending in torch.save's "unexpected pos
704 vs 598"; the `OSError: [Errno 28] No space left on device` is in its chain. `cause()`
finds the innermost operating-system or storage error and names it in one line.
"""

from __future__ import annotations

from collections.abc import Iterator

from runtime.checkpoint.layout import CheckpointError


class StorageError(CheckpointError):
    """A save failed in storage (disk full, permission denied, a store unreachable or refusing);
    the message names the checkpoint, the storage path, the cause and where a rerun resumes.
    """


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo = [error]
    while todo:
        exc = todo.pop(0)
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        failures = getattr(
            exc, "failures", None
        )  # DCP's CheckpointException: {rank: (exc, tb)}
        if isinstance(failures, dict):
            todo += [
                value[0] if isinstance(value, tuple) else value
                for value in failures.values()
            ]
        todo += [
            linked for linked in (exc.__cause__, exc.__context__) if linked is not None
        ]


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


# What to check, for the words a storage client's error holds (s3fs, botocore, aiohttp,
# gcsfs): a refusal, a bucket that is not there, a store that does not answer.
HINTS = (
    (
        (
            "(403)",
            "PermissionError",
            "Forbidden",
            "AccessDenied",
            "Access Denied",
            "SignatureDoesNotMatch",
            "InvalidAccessKeyId",
            "ExpiredToken",
        ),
        "the store refused: check the credentials in its usual environment variables "
        "or config files, and their permissions on this URL",
    ),
    (
        ("NoSuchBucket", "bucket does not exist"),
        "no such bucket: create it, or correct the URL",
    ),
    (
        (
            "Could not connect",
            "Connect call failed",
            "Connection refused",
            "ConnectTimeout",
            "Name or service not known",
            "Temporary failure in name resolution",
        ),
        "the store does not answer: check its endpoint (AWS_ENDPOINT_URL for s3://, or "
        "the backend's config file) and the network",
    ),
)


def cause(error: BaseException) -> str:
    """The innermost OS error (errno and file), else a storage client's error, else the first
    line; a refusal, a missing bucket or an unreachable store also says what to check.
    """
    return store_problem(error) or _cause(error)


def store_problem(error: BaseException) -> str | None:
    """`cause(error)` when the store refused, has no such bucket or does not answer; None
    for anything else (a missing file, a bad value: the caller says what those mean)."""
    found = _cause(error)
    for words, hint in HINTS:
        if any(word in found for word in words):
            return f"{found} ({hint})"
    return None


def _cause(error: BaseException) -> str:
    chain = list(_chain(error))
    for exc in chain:
        if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
            where = f" ({exc.filename})" if exc.filename else ""
            return f"{exc.strerror} [errno {exc.errno}]{where}"
    for exc in chain:
        module = type(exc).__module__ or ""
        if module.startswith(
            ("botocore", "aiobotocore", "s3fs", "gcsfs", "google", "aiohttp", "ocifs")
        ):
            return _first_line(exc)
    for exc in chain:
        if isinstance(
            exc, OSError
        ):  # s3fs maps refusals to PermissionError, FileNotFoundError
            return _first_line(exc)
    for exc in chain:
        if isinstance(exc, CheckpointError):
            return str(exc)
    return _first_line(chain[-1])


def resume_hint(last: str | None) -> str:
    if last is None:
        return "a rerun starts from scratch (no complete checkpoint yet)"
    return f"the checkpoints before it are intact: a rerun resumes from {last}"
