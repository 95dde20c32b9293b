"""The wire: the protocol's keys and message layout, reply validation, pseudo-label encodings."""
