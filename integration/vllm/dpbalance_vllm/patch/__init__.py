"""Every patch of upstream code in this package, one module per patched target (README.md)."""
