"""PII masking: what each pattern catches, what it leaves, and the counts."""

import pytest

from lmlab.curation import mask_emails, mask_ips, mask_phone_numbers, mask_pii


def test_emails_are_masked_and_counted():
    text, n = mask_emails("write to jane.doe+lists@mail.example.co.uk or bob@example.com, not to @handle")
    assert n == 2 and text == "write to |||EMAIL_ADDRESS||| or |||EMAIL_ADDRESS|||, not to @handle"


@pytest.mark.parametrize("number", ["(283) 182-3829", "(283)-182-3829", "+1 (283) 182-3829", "283-182-3829", "283.182.3829", "283 182 3829", "2831823829",
                                    "+1 283 182 3829", "1-283-182-3829"])
def test_us_phone_formats_are_masked(number):
    text, n = mask_phone_numbers(f"call {number} today")
    assert (text, n) == ("call |||PHONE_NUMBER||| today", 1)


def test_digits_that_are_not_phone_numbers_stay():
    for text in ["order 12345678", "id 283182382912345", "year 2024 and 1999"]:
        assert mask_phone_numbers(text) == (text, 0)


def test_ipv4_addresses_are_masked_but_not_versions_or_out_of_range_octets():
    text, n = mask_ips("hosts 192.168.0.1 and 10.0.0.255; version 1.2.3, not 256.1.1.1 or 1.2.3.4.5")
    assert n == 2 and text.startswith("hosts |||IP_ADDRESS||| and |||IP_ADDRESS|||;")
    assert "256.1.1.1" in text and "1.2.3.4.5" in text


def test_mask_pii_counts_each_kind():
    text, counts = mask_pii("mail a@b.org from 10.1.2.3 or phone 555-123-4567")
    assert counts == {"email": 1, "phone": 1, "ip": 1}
    assert "|||EMAIL_ADDRESS|||" in text and "|||IP_ADDRESS|||" in text and "|||PHONE_NUMBER|||" in text
