"""Pipeline parallelism. Import from the modules (this package imports nothing, so the torch-free
ones stay torch-free): ``partition`` (which layers a stage holds, ``build_stage``), ``schedules``
(tables and their simulator, pure Python) and ``executor`` (``forward_backward`` runs a table)."""
