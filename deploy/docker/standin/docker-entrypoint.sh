#!/bin/sh
# The stand-in Redis image's entrypoint: as the official one, flags or a .conf file first
# mean redis-server; as root, /data is given to the user redis and the server runs as it.
set -e
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
  set -- redis-server "$@"
fi
if [ "$1" = redis-server ] && [ "$(id -u)" = 0 ]; then
  find . \! -user redis -exec chown redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups "$0" "$@"
fi
exec "$@"
