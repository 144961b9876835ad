"""The data stage: text from HTML, language ID, PII masking, quality filters and deduplication.

Function shapes follow CS336's data assignment (`extract_text_from_html_bytes`, `identify_language`,
`mask_emails`, `gopher_quality_filter`, `exact_line_deduplication`, `minhash_deduplication`, ...); the
filters are also registry entries (`FILTERS`) that return a keep/drop decision with its reason.
`warcio`, `resiliparse` and `py3langid` come with `pip install 'lmlab[data]'`.
"""

from lmlab.curation.dedup import exact_document_deduplication, exact_line_deduplication, minhash_deduplication
from lmlab.curation.extract import extract_text_from_html_bytes, iter_warc_html
from lmlab.curation.filters import FILTERS, Decision, c4_rules, gopher_quality_filter, gopher_repetition
from lmlab.curation.langid import identify_language
from lmlab.curation.pii import mask_emails, mask_ips, mask_phone_numbers, mask_pii

__all__ = ["FILTERS", "Decision", "c4_rules", "exact_document_deduplication", "exact_line_deduplication", "extract_text_from_html_bytes",
           "gopher_quality_filter", "gopher_repetition", "identify_language", "iter_warc_html", "mask_emails",
           "mask_ips", "mask_phone_numbers", "mask_pii", "minhash_deduplication"]
