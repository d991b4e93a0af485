// An independent writer of tw-tkms's stored message format, for the drop-in tests: it stores
// messages exactly as tw-tkms's TkmsMessageSerializer does — a 3-byte header, then a protobuf
// StoredMessage.Message written by protobuf-java and compressed by the same Java libraries
// (snappy-java, zstd-jni, lz4-java, java.util.zip) — into outgoing_message_<shard>_<partition>
// with plain JDBC, in transactions.
//
// Message n (first <= n < first + count) is fully determined by n, so a test knows what must
// arrive: see describe() below and tests/tw_tkms.rs.
import com.github.luben.zstd.ZstdOutputStream;
import com.google.protobuf.ByteString;
import com.google.protobuf.DescriptorProtos.DescriptorProto;
import com.google.protobuf.DescriptorProtos.FieldDescriptorProto;
import com.google.protobuf.DescriptorProtos.FileDescriptorProto;
import com.google.protobuf.Descriptors.Descriptor;
import com.google.protobuf.Descriptors.FileDescriptor;
import com.google.protobuf.DynamicMessage;
import com.google.protobuf.UInt32Value;
import com.google.protobuf.UInt64Value;
import com.google.protobuf.WrappersProto;
import java.io.ByteArrayOutputStream;
import java.io.OutputStream;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.util.zip.GZIPOutputStream;
import net.jpountz.lz4.LZ4BlockOutputStream;
import net.jpountz.lz4.LZ4Factory;
import org.xerial.snappy.SnappyFramedOutputStream;
import org.xerial.snappy.SnappyOutputStream;

public class TkmsWriter {
  static final String[] COMPRESSIONS = {"none", "snappy_framed", "snappy", "zstd", "lz4", "gzip"};

  static Descriptor message;
  static Descriptor headers;
  static Descriptor header;

  /** stored_message.proto, built with protobuf-java's own descriptor API (no protoc needed). */
  static void describe() throws Exception {
    FieldDescriptorProto.Type string = FieldDescriptorProto.Type.TYPE_STRING;
    FieldDescriptorProto.Type bytes = FieldDescriptorProto.Type.TYPE_BYTES;
    FieldDescriptorProto.Type msg = FieldDescriptorProto.Type.TYPE_MESSAGE;
    FileDescriptorProto file = FileDescriptorProto.newBuilder()
        .setName("stored_message.proto").setSyntax("proto3")
        .addDependency("google/protobuf/wrappers.proto")
        .addMessageType(DescriptorProto.newBuilder().setName("Headers")
            .addField(field("headers", 1, msg, ".Header", true)))
        .addMessageType(DescriptorProto.newBuilder().setName("Header")
            .addField(field("key", 1, string, null, false))
            .addField(field("value", 2, bytes, null, false)))
        .addMessageType(DescriptorProto.newBuilder().setName("Message")
            .addField(field("topic", 1, string, null, false))
            .addField(field("partition", 2, msg, ".google.protobuf.UInt32Value", false))
            .addField(field("key", 3, string, null, false))
            .addField(field("timestamp", 4, msg, ".google.protobuf.UInt64Value", false))
            .addField(field("value", 5, bytes, null, false))
            .addField(field("headers", 6, msg, ".Headers", false))
            .addField(field("insertTimestamp", 7, msg, ".google.protobuf.UInt64Value", false)))
        .build();
    FileDescriptor fd = FileDescriptor.buildFrom(file, new FileDescriptor[] {WrappersProto.getDescriptor()});
    message = fd.findMessageTypeByName("Message");
    headers = fd.findMessageTypeByName("Headers");
    header = fd.findMessageTypeByName("Header");
  }

  static FieldDescriptorProto.Builder field(String name, int number, FieldDescriptorProto.Type type, String typeName,
      boolean repeated) {
    FieldDescriptorProto.Builder f = FieldDescriptorProto.newBuilder().setName(name).setNumber(number).setType(type)
        .setLabel(repeated ? FieldDescriptorProto.Label.LABEL_REPEATED : FieldDescriptorProto.Label.LABEL_OPTIONAL);
    return typeName == null ? f : f.setTypeName(typeName);
  }

  static String compressionOf(String choice, long n) {
    return choice.equals("all") ? COMPRESSIONS[(int) (n % COMPRESSIONS.length)] : choice;
  }

  /** Message n: see tests/tw_tkms.rs, which expects exactly this. */
  static DynamicMessage build(String topic, long n, String compression) {
    DynamicMessage.Builder b = DynamicMessage.newBuilder(message);
    b.setField(message.findFieldByName("topic"), topic);
    if (n % 11 != 0) {
      b.setField(message.findFieldByName("key"), "k" + (n % 7));
    }
    String value = "payload-" + n + "-" + "abcdefgh".repeat(20 + (int) (n % 40));
    b.setField(message.findFieldByName("value"), ByteString.copyFromUtf8(value));
    if (n % 3 == 0) {
      b.setField(message.findFieldByName("partition"), UInt32Value.of((int) (n % 2)));
    }
    if (n % 2 == 0) {
      b.setField(message.findFieldByName("timestamp"), UInt64Value.of(1_600_000_000_000L + n));
    }
    if (n % 5 != 0) {
      DynamicMessage.Builder hs = DynamicMessage.newBuilder(headers);
      for (String[] kv : new String[][] {{"n", Long.toString(n)}, {"compression", compression}}) {
        hs.addRepeatedField(headers.findFieldByName("headers"), DynamicMessage.newBuilder(header)
            .setField(header.findFieldByName("key"), kv[0])
            .setField(header.findFieldByName("value"), ByteString.copyFrom(kv[1], StandardCharsets.UTF_8))
            .build());
      }
      b.setField(message.findFieldByName("headers"), hs.build());
    }
    b.setField(message.findFieldByName("insertTimestamp"), UInt64Value.of(System.currentTimeMillis()));
    return b.build();
  }

  /** TkmsMessageSerializer.serialize's bytes, with its default block sizes and levels. */
  static byte[] store(DynamicMessage m, String compression) throws Exception {
    ByteArrayOutputStream os = new ByteArrayOutputStream();
    os.write(0);
    os.write(0);
    int type = java.util.Arrays.asList(COMPRESSIONS).indexOf(compression);
    if (type < 0) {
      throw new IllegalArgumentException("unknown compression " + compression);
    }
    // The position in COMPRESSIONS is tw-tkms's compression type.
    os.write(type);
    OutputStream out;
    switch (compression) {
      case "none": out = os; break;
      case "snappy_framed": out = new SnappyFramedOutputStream(os, SnappyFramedOutputStream.DEFAULT_BLOCK_SIZE,
          SnappyFramedOutputStream.DEFAULT_MIN_COMPRESSION_RATIO); break;
      case "snappy": out = new SnappyOutputStream(os, 32 * 1024); break;
      case "zstd": out = new ZstdOutputStream(os); break;
      case "lz4": out = new LZ4BlockOutputStream(os, 1 << 16, LZ4Factory.fastestJavaInstance().fastCompressor()); break;
      default: out = new GZIPOutputStream(os);
    }
    m.writeTo(out);
    out.close();
    return os.toByteArray();
  }

  public static void main(String[] args) throws Exception {
    if (args.length < 7) {
      System.err.println("usage: TkmsWriter <jdbc-url> <table> <first> <count> <per-transaction> <compression|all> <topic> [rollback-every]");
      System.exit(2);
    }
    String url = args[0], table = args[1], choice = args[5], topic = args[6];
    long first = Long.parseLong(args[2]), count = Long.parseLong(args[3]);
    int perTx = Integer.parseInt(args[4]);
    int rollbackEvery = args.length > 7 ? Integer.parseInt(args[7]) : 0;
    describe();
    long written = 0, rolledBack = 0;
    try (Connection c = DriverManager.getConnection(url)) {
      c.setAutoCommit(false);
      try (PreparedStatement insert = c.prepareStatement("insert into " + table + " (message) values (?)")) {
        long tx = 0;
        for (long n = first; n < first + count; n += perTx, tx++) {
          long end = Math.min(n + perTx, first + count);
          for (long i = n; i < end; i++) {
            String compression = compressionOf(choice, i);
            insert.setBytes(1, store(build(topic, i, compression), compression));
            insert.executeUpdate();
          }
          if (rollbackEvery > 0 && tx % rollbackEvery == rollbackEvery - 1) {
            c.rollback();
            rolledBack += end - n;
          } else {
            c.commit();
            written += end - n;
          }
        }
      }
    }
    System.out.println("tw-tkms writer: committed " + written + " messages, rolled back " + rolledBack);
  }
}
