"""The built-in families, each declared once (`registry.register_family`): SPLA, SSE / SSE-H, HLA.

Importing this package (done by `import subquadratic`) registers them.
"""

from . import hla, spla, sse  # noqa: F401  (each module registers its family)
