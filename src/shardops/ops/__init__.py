"""Op families. Importing this package registers every strategy."""
from . import pointwise, views  # noqa: F401
