"""Masking personal information: e-mail addresses, US phone numbers and IPv4 addresses, each replaced by a
placeholder. Each function returns the masked text and how many replacements it made."""

from __future__ import annotations

import re

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}")
# (123) 456-7890, (123)-456-7890, 123-456-7890, 123.456.7890, 123 456 7890, 1234567890, +1 123 456 7890: ten digits in US groups
PHONE = re.compile(r"(?<![\w+])(?:\+?1[\s.-]?)?(?:\(\d{3}\)[\s.-]?|\d{3}[\s.-]?)\d{3}[\s.-]?\d{4}(?!\w)")
IPV4 = re.compile(r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?![\d.]\d)")

EMAIL_TOKEN, PHONE_TOKEN, IP_TOKEN = "|||EMAIL_ADDRESS|||", "|||PHONE_NUMBER|||", "|||IP_ADDRESS|||"


def mask_emails(text: str) -> tuple[str, int]:
    return EMAIL.subn(EMAIL_TOKEN, text)


def mask_phone_numbers(text: str) -> tuple[str, int]:
    return PHONE.subn(PHONE_TOKEN, text)


def mask_ips(text: str) -> tuple[str, int]:
    return IPV4.subn(IP_TOKEN, text)


# kind -> its masking, in the order they run: e-mail first, since an address's digits are not a phone number's
MASKS = {"email": mask_emails, "phone": mask_phone_numbers, "ip": mask_ips}


def mask_pii(text: str) -> tuple[str, dict[str, int]]:
    """All three maskings, in MASKS' order, with counts by kind."""
    counts = {}
    for kind, mask in MASKS.items():
        text, counts[kind] = mask(text)
    return text, counts
