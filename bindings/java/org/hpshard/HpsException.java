package org.hpshard;

import org.hpshard.internal.hps_status_t;

/**
 * A failing hpshard call: the C status code ({@link #status()}) and the library's message
 * ({@link #getMessage()}, from hps_last_error_message on the failing thread).
 */
public class HpsException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  private final int status;

  /** Called by the JNI layer with the status and message of the failing call. */
  public HpsException(int status, String message) {
    super(message);
    this.status = status;
  }

  /** The hps_status_t code (HPS_STATUS_INVALID_ARGUMENT = 1, ...). */
  public int status() {
    return status;
  }

  /** The status name without prefix ("INVALID_ARGUMENT"), or "UNKNOWN(n)". */
  public String statusName() {
    return statusName(status);
  }

  /** The name of a status code without prefix ("OUT_OF_RANGE"), or "UNKNOWN(n)". */
  public static String statusName(int status) {
    switch (status) {
      case hps_status_t.HPS_STATUS_OK: return "OK";
      case hps_status_t.HPS_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
      case hps_status_t.HPS_STATUS_OUT_OF_RANGE: return "OUT_OF_RANGE";
      case hps_status_t.HPS_STATUS_NOT_FOUND: return "NOT_FOUND";
      case hps_status_t.HPS_STATUS_ALREADY_EXISTS: return "ALREADY_EXISTS";
      case hps_status_t.HPS_STATUS_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
      case hps_status_t.HPS_STATUS_UNIMPLEMENTED: return "UNIMPLEMENTED";
      case hps_status_t.HPS_STATUS_UNAVAILABLE: return "UNAVAILABLE";
      case hps_status_t.HPS_STATUS_TIMEOUT: return "TIMEOUT";
      case hps_status_t.HPS_STATUS_ABORTED: return "ABORTED";
      case hps_status_t.HPS_STATUS_OUT_OF_MEMORY: return "OUT_OF_MEMORY";
      case hps_status_t.HPS_STATUS_INTERNAL: return "INTERNAL";
      case hps_status_t.HPS_STATUS_BACKEND_ERROR: return "BACKEND_ERROR";
      default: return "UNKNOWN(" + status + ")";
    }
  }

  @Override
  public String toString() {
    return getClass().getName() + "[" + statusName() + "]: " + getMessage();
  }
}
