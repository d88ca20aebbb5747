"""The engine cache: architecture hash, front end, storage back ends and the runtime refit."""
