"""Utilities for a small inventory service: parsing orders, pricing and shipping."""

import datetime
import json
import logging
import re
from dataclasses import dataclass, field

LOGGER = logging.getLogger("inventory")
SKU_PATTERN = re.compile(r"^[A-Z]{3}-\d{4}$")
