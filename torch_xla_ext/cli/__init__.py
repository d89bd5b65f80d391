"""The command line, ``python -m torch_xla_ext {demo,audit,tpu-fit}``: the parser (``main``), the demo
(``demo``) and ``tpu-fit``'s table and PNG (``tpu_fit``). Nothing here is imported by the library."""
