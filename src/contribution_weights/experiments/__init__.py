"""Experiments built on capture and measures: faithfulness, value geometry, sinks."""
