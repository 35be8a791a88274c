"""The domains a continual run moves through, in the paper's order: the one definition that the
config, the data records and the verifiers read."""

DOMAINS: tuple[str, ...] = ("math", "science", "tooluse", "code")
