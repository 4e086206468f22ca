"""The one way an extension registers itself by name.

Each kind of extension (policy losses, advantage estimators, environments, tasks, reward kinds, log sinks, model
families) has one :class:`Registry`, and each extension adds itself to it with ``@registry.register(name)`` above
its definition, in the file that implements it. Whatever reads the names (the config validator, a factory, an
error message) reads them off the registry, so a new extension is one definition in one file::

    @POLICY_LOSSES.register("my_loss")
    def my_loss(log_prob, old_log_prob, advantages, mask, options): ...

A registry only knows its entries by name: importing the module that defines an extension registers it.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")

# How a kind words the error for a name it does not know: (the name asked for, the registered names) -> one line.
UnknownMessage = Callable[[str, tuple[str, ...]], str]


class Registry(Mapping[str, T], Generic[T]):
    """The extensions of one ``kind`` by name, in the order they registered.

    ``register(name)`` is the decorator that adds one (a name registered twice is refused, so two extensions
    cannot silently shadow each other); :meth:`lookup` returns one or raises a one-line ``ValueError`` listing the
    valid names, in the kind's own words when ``unknown`` is given. As a read-only mapping it answers ``in``,
    ``len``, iteration over the names and ``get``.
    """

    def __init__(self, kind: str, unknown: UnknownMessage | None = None):
        self.kind = kind
        self._unknown = unknown
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """The decorator that registers what it decorates under ``name`` and returns it unchanged."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} is registered under a non-empty name, got {name!r}")

        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return add

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def lookup(self, name: str) -> T:
        """The entry registered as ``name``; a one-line ``ValueError`` listing the valid names otherwise."""
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(self.unknown_message(name))
        return self._entries[name]

    def unknown_message(self, name: str) -> str:
        """The one line that says ``name`` is not registered and lists the names that are."""
        if self._unknown is not None:
            return self._unknown(name, self.names())
        return f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}"

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
