// Validates KEDA ScaledObjects and TriggerAuthentications and Strimzi KafkaTopics and
// KafkaUsers (JSON documents, one array on stdin) against the schemas generated from those
// projects' CRDs (@kubernetes-models/*).
// Prints one line per document: "ok <kind>/<name>" or "invalid <kind>/<name>: <why>".
import {
  ScaledObject,
  TriggerAuthentication,
} from "@kubernetes-models/keda/keda.sh/v1alpha1";
import {
  KafkaTopic,
  KafkaUser,
} from "@kubernetes-models/strimzi-kafka-operator/kafka.strimzi.io/v1beta2";

const kinds = { ScaledObject, TriggerAuthentication, KafkaTopic, KafkaUser };
let input = "";
for await (const chunk of process.stdin) input += chunk;
for (const doc of JSON.parse(input)) {
  const name = `${doc.kind}/${doc.metadata?.name}`;
  const Model = kinds[doc.kind];
  if (!Model) {
    console.log(`invalid ${name}: no schema for this kind here`);
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`ok ${name}`);
  } catch (error) {
    console.log(`invalid ${name}: ${String(error.message).replace(/\n/g, " ")}`);
  }
}
