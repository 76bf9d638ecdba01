"""The offline teacher-logit cache: a Lightning predict job writes it, CachedTeacher reads it.

See docs/cache.md for the format and its rules.
"""

from distill.cache.format import CacheMismatch, content_hash, read_metadata
from distill.cache.job import CacheJob, CacheSettings
from distill.cache.reader import TeacherCache
from distill.cache.verify import CacheDamaged

__all__ = ["CacheDamaged", "CacheJob", "CacheMismatch", "CacheSettings", "TeacherCache",
           "content_hash", "read_metadata"]
