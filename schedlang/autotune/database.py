"""Tuning results cached in a JSON file, keyed by configuration."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from ..logger import get_logger

__all__ = ["Database", "config_key"]

logger = get_logger("schedlang.autotune")


def config_key(config: Dict[str, Any]) -> str:
    """A stable key for a configuration (its items sorted, as JSON)."""
    return json.dumps(config, sort_keys=True, default=str)


class Database:
    """``commit(key, data)`` stores and (with a file) writes through; ``get(key)`` reads back."""

    def __init__(self, db_file_name: Optional[str] = None):
        self.db_file_name = db_file_name
        self.db: Dict[str, Any] = {}
        self.load()

    def load(self) -> None:
        if self.db_file_name and os.path.exists(self.db_file_name):
            with open(self.db_file_name, encoding="utf-8") as f:
                self.db = json.load(f)
            logger.info("loaded %d tuning records from %s", len(self.db), self.db_file_name)

    def commit(self, key: str, data: Any) -> None:
        self.db[key] = data
        if self.db_file_name:
            tmp = f"{self.db_file_name}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.db, f, indent=2, sort_keys=True)
            os.replace(tmp, self.db_file_name)  # a crash mid-write never leaves half a file

    def get(self, key: str, default: Any = None) -> Any:
        return self.db.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.db

    def __len__(self) -> int:
        return len(self.db)
