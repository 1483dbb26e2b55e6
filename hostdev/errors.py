"""Errors of the host model, each with a message a person can act on."""


class HostdevError(Exception):
    """Base of every error raised by `hostdev`."""


class InvalidBdf(HostdevError, ValueError):
    """A text that is not a PCI address in the kernel's form."""

    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__(
            f"invalid PCI address {text!r}: expected dddd:bb:ss.f in lower-case hex,"
            " for example 0000:3b:00.0 (see `lspci -D`)"
        )


class HostReadError(HostdevError):
    """A sysfs or /dev entry that exists but cannot be read or makes no sense."""

    def __init__(self, path: str, problem: str, fix: str = "") -> None:
        self.path = path
        self.problem = problem
        message = f"cannot read {path}: {problem}"
        super().__init__(f"{message}; {fix}" if fix else message)


class RootNotFound(HostdevError):
    """The root directory given for the host does not exist or is not a directory."""

    def __init__(self, root: str) -> None:
        self.root = root
        super().__init__(
            f"host root {root!r} is not a directory; pass --root with the directory that holds"
            " the host's sys/ and dev/ (the default / is right on a node)"
        )


class PciIdsError(HostdevError):
    """A pci.ids database that does not follow the file's format."""

    def __init__(self, path: str, line_number: int, problem: str) -> None:
        self.path = path
        self.line_number = line_number
        super().__init__(
            f"{path}:{line_number}: {problem}; install a good copy (Debian package pci.ids)"
            " or pass --pci-ids none to go without device names"
        )
