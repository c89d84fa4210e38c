#!/usr/bin/env bash
# Starts compose's Kafka (apache/kafka image, KRaft, one node) with SASL/SCRAM users.
#
# The image's own entrypoint turns KAFKA_* variables into server.properties and formats the
# storage, but cannot create SCRAM users at format time; with KRaft they must exist before
# the first client logs in (they live in the metadata log). So this script does both:
#   1. server.properties from KAFKA_* (the image's naming: KAFKA_FOO_BAR -> foo.bar,
#      `__` -> `_`, `___` -> `-`), plus the listeners' JAAS logins, which hold passwords and
#      so are built here from MARLAAS_KAFKA_PASSWORD_* instead of sitting in compose.yaml;
#   2. on the first start only (no meta.properties yet), `kafka-storage.sh format` with one
#      `--add-scram` per MARLAAS_KAFKA_PASSWORD_<PRINCIPAL> (user: the principal in lower
#      case); later password changes are applied by deploy/kafka/acls.sh as the operator;
#   3. an operator client login for the healthcheck;
#   4. exec the broker.
# Nothing here has run against a broker in this repository's tests (see deploy/kafka/acls.sh).
set -euo pipefail
umask 077

conf=/tmp/marlaas-kafka
mkdir -p "$conf"
props=$conf/server.properties

password_of() {
  local variable=MARLAAS_KAFKA_PASSWORD_$1 value
  value=${!variable:-}
  # The passwords go into JAAS lines and `--add-scram 'SCRAM-SHA-512=[...]'`: quotes, commas
  # or brackets would break them (`openssl rand -hex 24` makes safe ones).
  if [[ ! $value =~ ^[A-Za-z0-9_-]{16,}$ ]]; then
    echo "start.sh: $variable must be 16+ of [A-Za-z0-9_-] (deploy/env.example)" >&2
    exit 1
  fi
  printf '%s' "$value"
}

operator_password=$(password_of OPERATOR)

{
  while IFS='=' read -r variable _; do
    case $variable in
      # The JVM's and the start scripts' own variables, not broker settings.
      KAFKA_OPTS|KAFKA_HEAP_OPTS|KAFKA_JVM_PERFORMANCE_OPTS|KAFKA_GC_LOG_OPTS|KAFKA_LOG4J_OPTS|KAFKA_JMX_OPTS|KAFKA_DEBUG) continue ;;
    esac
    name=${variable#KAFKA_}
    name=${name,,}
    name=${name//___/-}
    name=${name//__/@}
    name=${name//_/.}
    name=${name//@/_}
    printf '%s=%s\n' "$name" "${!variable}"
  done < <(env | grep -E '^KAFKA_[A-Z0-9_]+=' | sort)
  # The broker's inter-broker client logs in to INTERNAL as the operator (a super user).
  printf '%s\n' \
    "listener.name.internal.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username=\"operator\" password=\"$operator_password\";" \
    "listener.name.host.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;"
  # The controller cannot check SCRAM (its users live in the log it serves), so its
  # listener uses PLAIN with one static user, the operator, for the broker half of this
  # same process; it listens on loopback only.
  printf '%s\n' \
    "listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username=\"operator\" password=\"$operator_password\" user_operator=\"$operator_password\";"
} > "$props"

data_dir=${KAFKA_LOG_DIRS:?KAFKA_LOG_DIRS names the data volume}
if [[ ! -f $data_dir/meta.properties ]]; then
  scram=()
  while IFS='=' read -r variable _; do
    principal=${variable#MARLAAS_KAFKA_PASSWORD_}
    scram+=(--add-scram "SCRAM-SHA-512=[name=${principal,,},password=$(password_of "$principal")]")
  done < <(env | grep -E '^MARLAAS_KAFKA_PASSWORD_[A-Z0-9_]+=' | sort)
  echo "start.sh: formatting $data_dir with $((${#scram[@]} / 2)) SCRAM users"
  /opt/kafka/bin/kafka-storage.sh format --config "$props" --cluster-id "${CLUSTER_ID:?}" "${scram[@]}"
fi

cat > "$conf/operator.properties" <<EOF
security.protocol=SASL_PLAINTEXT
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="operator" password="$operator_password";
EOF

exec /opt/kafka/bin/kafka-server-start.sh "$props"
