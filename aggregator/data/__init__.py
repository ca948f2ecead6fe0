"""Packaged data files of the aggregator (the Xid catalog CSV)."""
