"""pdcluster: disaggregated prefill/decode LLM serving (command-line entry points live here)."""

__version__ = "0.1.0"
