"""Storage URLs (``format/urls.py``): the one place a path's scheme is read, and what the
callers build from it (storage's record kvstore, the tier's remote-storage test)."""

import os

import pytest

from orbax_pathways.format import urls
from orbax_pathways.storage import meta_io
from orbax_pathways.tier import config as tier_config


@pytest.mark.parametrize('path,scheme,url,remote', [
    ('/tmp/ckpt', '', False, False),
    ('relative/ckpt', '', False, False),
    ('file:///tmp/ckpt', 'file', True, False),
    ('gs://bucket/ckpt', 'gs', True, True),
    ('s3://bucket/ckpt', 's3', True, True),
    ('memory://ckpt', 'memory', True, True),
])
def test_scheme_url_and_remote(path, scheme, url, remote):
  assert (urls.scheme(path), urls.is_url(path), urls.is_remote(path)) == (scheme, url, remote)
  assert tier_config.storage_is_remote(path) == remote or not url  # local paths: by filesystem


def test_bucket_kvstores_keep_the_key_as_written():
  assert urls.bucket_kvstore('gs://b/ck/1') == {'driver': 'gcs', 'bucket': 'b', 'path': 'ck/1'}
  assert urls.bucket_kvstore('gs://b/ck/', gcs_driver='gcs_grpc') == {
      'driver': 'gcs_grpc', 'bucket': 'b', 'path': 'ck/'}
  assert urls.bucket_kvstore('s3://b/ck') == {'driver': 's3', 'bucket': 'b', 'path': 'ck'}
  assert urls.bucket_kvstore('gs://b') == {'driver': 'gcs', 'bucket': 'b', 'path': ''}
  assert urls.bucket_kvstore('/tmp/ck') is None and urls.bucket_kvstore('file:///ck') is None


def test_the_records_kvstore_of_each_kind_of_directory():
  """The kvstore storage's records (``_pathways/``, the lease) are read and written through."""
  assert meta_io.kvstore_spec('/tmp/ck/1/state/') == {'driver': 'file', 'path': '/tmp/ck/1/state/'}
  assert meta_io.kvstore_spec('rel') == {'driver': 'file', 'path': os.path.abspath('rel') + '/'}
  assert meta_io.kvstore_spec('file:///tmp/ck') == {'driver': 'file', 'path': '/tmp/ck/'}
  assert meta_io.kvstore_spec('gs://b/ck/1') == {'driver': 'gcs', 'bucket': 'b', 'path': 'ck/1/'}
  assert meta_io.kvstore_spec('gs://b') == {'driver': 'gcs', 'bucket': 'b', 'path': ''}
  assert meta_io.kvstore_spec('s3://b/ck') == {'driver': 's3', 'bucket': 'b', 'path': 'ck/'}
  assert meta_io.kvstore_spec('memory://ck')['driver'] == 'memory'
