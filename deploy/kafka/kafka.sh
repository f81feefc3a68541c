#!/usr/bin/env bash
# Single-node Apache Kafka 4.x (KRaft, combined broker+controller) on loopback, for CI and
# local development. Jars come from Maven Central through deploy/kafka/pom.xml.
#
#   deploy/kafka/kafka.sh start    resolve jars (once), format storage, start, wait until it answers;
#                                  prints the bootstrap address (also in $GUARD_CI_KAFKA_DIR/bootstrap)
#   deploy/kafka/kafka.sh stop     stop it (SIGTERM, then SIGKILL after 30 s) and delete its data
#   deploy/kafka/kafka.sh halt     stop it the same way but keep its data, ports and credentials
#   deploy/kafka/kafka.sh resume   start the halted broker again: same data, ports, cluster id
#   deploy/kafka/kafka.sh status   running or not, and where
#   deploy/kafka/kafka.sh sasl-env print the GUARD_KAFKA_* settings of its SASL listener (eval them)
#
# Besides the PLAINTEXT listener the broker has a SASL_PLAINTEXT listener with SCRAM-SHA-256
# (the user is created at storage format time, KRaft's `--add-scram`) and PLAIN, on loopback.
#
# Environment: GUARD_CI_KAFKA_DIR (work folder, default deploy/kafka/.run), GUARD_CI_KAFKA_LIB
# (where the jars go, default $GUARD_CI_KAFKA_DIR/lib: share it between brokers), GUARD_CI_KAFKA_PORT
# (default: a free port), GUARD_CI_KAFKA_SASL_PORT (default: a free port),
# GUARD_CI_KAFKA_SASL_USER / GUARD_CI_KAFKA_SASL_PASSWORD (default guard / a random one, kept in
# the work folder), KAFKA_HEAP_OPTS (default -Xms256m -Xmx768m), GUARD_CI_KAFKA_START_TIMEOUT (s, 120).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dir="${GUARD_CI_KAFKA_DIR:-$here/.run}"
lib="${GUARD_CI_KAFKA_LIB:-$dir/lib}"
pidfile="$dir/kafka.pid"

log() { echo "kafka.sh: $*" >&2; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

resolve_jars() {
  if [[ -f "$lib/.complete" ]]; then return; fi
  command -v mvn >/dev/null || { log "mvn not found: install Maven (apt-get install maven)"; exit 1; }
  command -v java >/dev/null || { log "java not found: install a JDK >= 17"; exit 1; }
  log "resolving Apache Kafka jars from Maven Central into $lib"
  rm -rf "$lib"; mkdir -p "$lib"
  mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies \
      -Dstyle.color=never -DoutputDirectory="$lib" -DincludeScope=runtime >&2
  touch "$lib/.complete"
}

started_count() { cat "$dir/logs/server.log" 2>/dev/null | grep -c "Kafka Server started" || true; }

is_running() { [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

start() {
  if is_running; then log "already running (pid $(cat "$pidfile"))"; cat "$dir/bootstrap"; return; fi
  resolve_jars
  local port="${GUARD_CI_KAFKA_PORT:-$(free_port)}" cport sport user password
  cport="$(free_port)"
  sport="${GUARD_CI_KAFKA_SASL_PORT:-$(free_port)}"
  user="${GUARD_CI_KAFKA_SASL_USER:-guard}"
  password="${GUARD_CI_KAFKA_SASL_PASSWORD:-$(python3 -c 'import secrets; print(secrets.token_hex(16))')}"
  rm -rf "$dir/data" "$dir/logs" "$dir/server.properties" "$dir/sasl.env"; mkdir -p "$dir/data" "$dir/logs"
  (umask 077; printf 'GUARD_KAFKA_BOOTSTRAP=127.0.0.1:%s\nGUARD_KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT\nGUARD_KAFKA_SASL_MECHANISM=SCRAM-SHA-256\nGUARD_KAFKA_SASL_USERNAME=%s\nGUARD_KAFKA_SASL_PASSWORD=%s\n' \
     "$sport" "$user" "$password" > "$dir/sasl.env")
  (umask 077; cat > "$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=PLAINTEXT://127.0.0.1:$port,SASL_PLAINTEXT://127.0.0.1:$sport,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port,SASL_PLAINTEXT://127.0.0.1:$sport
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT
sasl.enabled.mechanisms=SCRAM-SHA-256,PLAIN
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$user="$password";
log.dirs=$dir/data
num.partitions=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.retention.check.interval.ms=60000
PROPS
  )
  cat > "$dir/log4j2.properties" <<PROPS
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = $dir/logs/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
PROPS
  set_java_opts
  local cp="$lib/*"
  local cluster_id
  # what `StorageTool random-uuid` prints (16 random bytes, base64url, never starting with
  # '-', which the tool's argument parser would take for an option), without a JVM start
  cluster_id="$(python3 -c '
import base64, uuid
while (cid := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"):
    pass
print(cid)')"
  java -cp "$cp" "${java_opts[@]}" kafka.tools.StorageTool format \
       -t "$cluster_id" -c "$dir/server.properties" \
       --add-scram "SCRAM-SHA-256=[name=$user,password=$password]" >"$dir/logs/format.log" 2>&1 \
    || { log "storage format failed:"; cat "$dir/logs/format.log" >&2; exit 1; }
  echo "127.0.0.1:$port" >"$dir/bootstrap"
  launch
}

set_java_opts() {
  java_opts=(${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m} -XX:+UseG1GC -XX:MaxGCPauseMillis=20
             -Djava.awt.headless=true -Dlog4j2.configurationFile="$dir/log4j2.properties")
}

# Start the formatted broker in $dir and wait until it answers; print its bootstrap address.
launch() {
  set_java_opts
  local cp="$lib/*" t0=$SECONDS
  nohup java -cp "$cp" "${java_opts[@]}" kafka.Kafka "$dir/server.properties" \
        >"$dir/logs/stdout.log" 2>&1 &
  echo $! >"$pidfile"
  local deadline=$((SECONDS + ${GUARD_CI_KAFKA_START_TIMEOUT:-120}))
  local seen; seen="$(started_count)"  # server.log is appended to: wait for a new line
  until (( $(started_count) > seen )); do
    if ! is_running; then
      log "broker exited during start-up; last lines of its logs:"
      tail -n 40 "$dir/logs/stdout.log" "$dir/logs/server.log" >&2 2>/dev/null || true
      exit 1
    fi
    if (( SECONDS > deadline )); then
      log "broker did not start within ${GUARD_CI_KAFKA_START_TIMEOUT:-120} s; see $dir/logs"; stop; exit 1
    fi
    sleep 0.5
  done
  log "Apache Kafka up at $(cat "$dir/bootstrap") (SASL: kafka.sh sasl-env) after $((SECONDS - t0)) s (pid $(cat "$pidfile"))"
  cat "$dir/bootstrap"
}

halt() {
  if ! is_running; then log "not running"; rm -f "$pidfile"; return; fi
  local pid; pid="$(cat "$pidfile")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then log "still alive after 30 s, killing"; kill -KILL "$pid" || true; fi
  rm -f "$pidfile"
  log "stopped (data kept in $dir/data)"
}

stop() { halt; rm -rf "$dir/data"; }

resume() {
  if is_running; then log "already running (pid $(cat "$pidfile"))"; cat "$dir/bootstrap"; return; fi
  [[ -f "$dir/server.properties" && -d "$dir/data" && -f "$dir/bootstrap" ]] \
    || { log "nothing to resume in $dir (halted with 'kafka.sh halt'?): use 'kafka.sh start'"; exit 1; }
  launch
}

status() {
  if is_running; then echo "running pid $(cat "$pidfile") at $(cat "$dir/bootstrap")"; else echo "not running"; return 1; fi
}

sasl_env() {
  is_running || { log "not running: start it first"; exit 1; }
  sed 's/^/export /' "$dir/sasl.env"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  halt) halt ;;
  resume) resume ;;
  status) status ;;
  sasl-env) sasl_env ;;
  *) echo "usage: $0 start|stop|halt|resume|status|sasl-env" >&2; exit 2 ;;
esac
