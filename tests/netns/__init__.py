"""Agents on separate hosts: one network namespace each, faults injected with iptables."""
