"""Known noise of third-party imports: lines libraries print on stderr about each other's
internals when imported together, which a user can neither act on nor fix.

    from runtime import quiet

    quiet.torchao_import_warnings()  # before transformers, peft, diffusers or torchao

torchao (the `float8` extra) is imported by transformers, peft and diffusers whenever it
is installed, as they load their model classes. With torchao 0.18 under torch 2.14 that
prints, before anything of the project's own:
- on torch's `torch.utils._pytree` logger, a warning for each Enum that torchao registers
  with `register_constant` (KernelPreference, ScaleCalculationMode): torch now treats
  Enums as opaque values itself and deprecates that registration;
- on diffusers' torchao quantizer's logger, "Unable to import `torchao` Tensor objects":
  diffusers looks for tensor classes torchao 0.18 moved; it concerns loading
  torchao-serialized checkpoints, which these projects never do.
A bad setting would then not be one `error:` line. `torchao_import_warnings()` adds a
filter to each of those two loggers that drops exactly those records (the pytree warning
only for torchao's own Enums); every other record, of those loggers or any other, is
printed as before. It changes no level and no handler, and calling it again adds nothing.
It is a call, not an import side effect of `runtime`: what it hides is written where it
happens, in the file that imports the libraries.
"""

from __future__ import annotations

import logging

# (logger, text of the message template to drop, module prefix of its first argument)
PYTREE_ENUM = (
    "torch.utils._pytree",
    "register_constant() on Enum subclasses is deprecated",
    "torchao.",
)
DIFFUSERS_TORCHAO = (
    "diffusers.quantizers.torchao.torchao_quantizer",
    "Unable to import `torchao` Tensor objects",
    "",
)


class DropRecord(logging.Filter):
    """Drops a logger's records whose message template contains `text` and, when
    `module` is given, whose first argument is a class of a module starting with it."""

    def __init__(self, text: str, module: str) -> None:
        super().__init__()
        self.text = text
        self.module = module

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text not in str(record.msg):
            return True
        if not self.module:
            return False
        args = record.args if isinstance(record.args, tuple) else ()
        first = getattr(args[0], "__module__", "") if args else ""
        return not str(first).startswith(self.module)


def torchao_import_warnings() -> None:
    """Hide the lines torchao's import prints through torch and diffusers (above)."""
    for name, text, module in (PYTREE_ENUM, DIFFUSERS_TORCHAO):
        logger = logging.getLogger(name)
        if not any(
            isinstance(known, DropRecord) and known.text == text
            for known in logger.filters
        ):
            logger.addFilter(DropRecord(text, module))
