"""Data: the record format (records), loaders for public dataset schemas (loaders), and the
built-in synthetic suite (synthetic). Submodules are imported where used to keep this cheap."""
