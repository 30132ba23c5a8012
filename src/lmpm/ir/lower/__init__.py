"""The lowerings from AST to IR, one module per sub-language over one shared scope
(:mod:`lmpm.ir.build` is their driver): ``scope`` (the declarations and a statement's names),
``exprs`` (what every statement shares), ``core``, ``train`` and ``workflow``."""
