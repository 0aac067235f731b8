# Sourced by every device call: the unpacked wheels and the source tree on the path.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
R=/root/res D=/root/dsite
mkdir -p $R /root/parts
