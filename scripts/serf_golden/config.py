"""Ports, node names, keys, the user event, the memberlist/serf message-type tables and
the kinds the corpus must cover.
"""

from __future__ import annotations

GOSSIP_BASE_PORT = 27946
RPC_BASE_PORT = 27373
GID_BASE = 47101  # one group id per agent, used by the iptables owner match
NODE_NAMES = ("a", "b", "c")

# Fixed keys so the corpus can be decrypted by tests.  k1 (AES-128) is the key the
# encrypted cluster starts with; k2 (AES-256) is installed and made primary halfway.
KEYS: dict[str, str] = {
    "k1": "3C1WjrC+MImqascFiR2BkQ==",
    "k2": "vREx0vqoIGayhPzoLApegna8qFqaGT74EPF7D1tV4L0=",
}

USER_EVENT_NAME = "golden-deploy"
USER_EVENT_PAYLOAD = "payload-0123456789"

MSG_NAMES: dict[int, str] = {
    0: "ping",
    1: "indirectPing",
    2: "ack",
    3: "suspect",
    4: "alive",
    5: "dead",
    6: "pushPull",
    7: "compound",
    8: "user",
    9: "compress",
    10: "encrypt",
    11: "nack",
    12: "crc",
    13: "err",
}
NODE_STATES: dict[int, str] = {0: "alive", 1: "suspect", 2: "dead", 3: "left"}
SERF_MSG_NAMES: dict[int, str] = {
    0: "leave",
    1: "join",
    2: "pushPull",
    3: "userEvent",
    4: "query",
    5: "queryResponse",
    6: "conflictResponse",
    7: "keyRequest",
    8: "keyResponse",
    9: "relay",
}

# Kinds the corpus must contain, checked against the summaries: name -> (transport, pattern).
REQUIRED_KINDS: dict[str, tuple[str | None, str]] = {
    "ping": ("udp", r"(?<![A-Za-z])ping\b"),
    "ack": ("udp", r"\back\b"),
    "indirectPing": ("udp", r"\bindirectPing\b"),
    "nack": ("udp", r"\bnack\b"),
    "suspect": ("udp", r"\bsuspect\b"),
    "alive": ("udp", r"\balive\b"),
    "dead(failed)": ("udp", r"\bdead\b(?!\(left\))"),
    "dead(left)": ("udp", r"\bdead\(left\)"),
    "compound": ("udp", r"\bcompound\["),
    "compress": (None, r"\bcompress>"),
    "crc": ("udp", r"\bcrc>"),
    "user": ("udp", r"\buser\("),
    "user(serf:userEvent)": ("udp", r"user\(serf:userEvent\)"),
    "pushPull(join)": ("tcp", r"pushPull\(join=true"),
    "pushPull(periodic)": ("tcp", r"pushPull\(join=false"),
    "tcp ping": ("tcp", r"(?<![A-Za-z])ping\b"),
    "tcp ack": ("tcp", r"\back\b"),
    "encrypted udp": ("udp", r"^encrypted v"),
    "encrypted tcp": ("tcp", r"^encrypted v"),
}
