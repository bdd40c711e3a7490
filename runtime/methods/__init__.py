"""Decoding methods by name: one grammar (runtime.methods.grammar), parsed once into a MethodSpec whose
options are a typed value of the method's own, built into a runnable Method.

A method is one module here: its frozen options dataclass (parse, format, build) and one
`register_method` call; the import below is what adds it to the registry.
"""

from __future__ import annotations

from runtime.drafters import DrafterSpec
# isort: off
# Each registers its methods, in the order --help lists them.
from runtime.methods import plain, chain, tree, mjsd, llamacpp  # noqa: F401
# isort: on
from runtime.methods.build import Method, build_method
from runtime.methods.grammar import DEFAULT_METHOD_HELP, SERVING_DEFAULT_METHOD_HELP, check_distinct, default_method, methods_help, parse_method, parse_methods
from runtime.methods.registry import ALIASES, METHODS, MethodAlias, MethodEntry, register_alias, register_method
from runtime.methods.spec import HEADS, NOT_PRESERVING, MethodSpec, canonical, marked, preserves_distribution
from runtime.methods.streamer import Streamer

__all__ = ["ALIASES", "DEFAULT_METHOD_HELP", "HEADS", "METHODS", "NOT_PRESERVING", "SERVING_DEFAULT_METHOD_HELP", "DrafterSpec", "Method", "MethodAlias",
           "MethodEntry", "MethodSpec", "Streamer", "build_method", "canonical", "check_distinct", "default_method", "marked",
           "methods_help", "parse_method", "parse_methods", "preserves_distribution", "register_alias", "register_method"]
