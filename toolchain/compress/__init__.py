"""Weight compression: the precision policy, NNCF and the int8-per-head pass on both targets, calibration text,
and the error measurements that go into compression.json. The stage is toolchain/stages/compress.py."""
